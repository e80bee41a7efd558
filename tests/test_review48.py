"""Review 48's findings on the documented commands, each a case that failed before its fix."""

from __future__ import annotations

import pytest

from densetrain.cli import main
from densetrain.data.tokenizer import load_tokenizer
from densetrain.hf import tokenizer_files


def test_readme_dry_run_of_the_8b_preset_prints_the_plan_before_its_refusals(capsys, monkeypatch):
    # README's `densetrain train --preset llama3-8b --dry-run` (no --world-size): the long_context stage's own
    # layout (cp 8) does not run on the one process of a plain run. It printed only that line and exit 2; the
    # dry run's contract (docs/planner.md) is the plan first, then each reason on its own error line.
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "--preset", "llama3-8b", "--dry-run", "--gpu-memory-gib", "80"]) == 2
    cap = capsys.readouterr()
    assert "dry run: 1 process(es), 80 GiB per GPU (given)" in cap.out
    assert "stage 'long_context': seq_len 131072" in cap.out
    errors = cap.err.splitlines()
    assert all(line.startswith("densetrain: error: ") for line in errors), errors
    assert any("stage 'long_context' (stages[2].parallel)" in line and "cp 8 = 8 do not divide the world size 1"
               in line for line in errors), errors
    # the documented form with a world size prints the plan and runs
    assert main(["train", "--preset", "llama3-8b", "--dry-run", "--world-size", "64", "--gpu-memory-gib", "80"]) == 0
    assert "configured layout of stage 'long_context'" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["gpt2", "llama3"])
def test_exported_tokenizer_reads_a_special_tokens_text_as_text_like_ours(name, tmp_path):
    # A document that quotes "<|endoftext|>" (docs about GPT-2, chat logs): our encode reads it as text, as the
    # shards hold it; AutoTokenizer on the export mapped it to the EOS id, so transformers and lm-eval scored
    # other ids than densetrain's own eval.
    from transformers import AutoTokenizer

    ours = load_tokenizer(name, ".")
    for fname, content in tokenizer_files(ours, 4096).items():
        (tmp_path / fname).write_bytes(content)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in (f"see {ours.eos_token} here", ours.eos_token, f"{ours.bos_token or ''}a{ours.eos_token}b"):
        ids = ours.encode(text)
        assert ours.eos_id not in ids
        assert hf(text, add_special_tokens=False)["input_ids"] == ids, text
        assert hf.decode(ids) == text
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id) == (ours.eos_id, ours.eos_id, ours.bos_id)
