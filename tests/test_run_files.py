"""Run files validated like configs: crafted ``trainer_state.json``, rollback events in ``events.jsonl``
and DCP ``.metadata`` storage paths each fail with one line naming the file and key, never a traceback,
a hang, a silent acceptance or a read outside the checkpoint directory; ``blame`` refuses shards other
than those the step was trained on. Table-driven: each row is one crafted input and the words its line
must hold. The crafted files get an honest completion marker (as a forger would write one), so what is
tested is the validation, not the digests (tests/test_checkpoint_verify.py)."""

from __future__ import annotations

import json
import pickle
import shutil
import time

import pytest
from conftest import forge_marker

from densetrain.checkpoint import list_complete, read_trainer_state
from densetrain.cli import main
from densetrain.dcp_read import CheckpointReadError, read_metadata


def _copy(stopped_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(stopped_run[0], run)
    return run, [p for _, p in list_complete(run)]


def _one_line(capsys, argv) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("densetrain: error: "), err
    return err


def _set(d: dict, dotted: str, value) -> dict:
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d[k]
    if value is _DELETE:
        del d[keys[-1]]
    else:
        d[keys[-1]] = value
    return d


_DELETE = object()

# (key, crafted value or raw file text, words the one line must hold)
TRAINER_STATE_CASES = [
    ("", [], "(top level): expected an object"),
    ("step", "3", "step: expected an integer 0..10^12"),
    ("step", -1, "step: expected an integer 0..10^12"),
    ("step", 10**13, "step: expected an integer 0..10^12"),
    ("step", True, "step: expected an integer 0..10^12"),
    ("step", 7, "step: expected 3, the step of its checkpoint directory"),  # silently resumed at step 7 before
    ("step", _DELETE, "step: missing"),
    ("tokens", 1.5, "tokens: expected an integer >= 0"),
    ("skipped_steps", 99, "skipped_steps: expected at most step (3)"),  # silently accepted before
    ("stage", 5, "stage: expected a string"),
    ("dtype", "fp16", "dtype: expected 'fp32' or 'bf16'"),  # silently measured again before
    ("world_size", 0, "world_size: expected an integer 1..2^20"),
    ("layout", {"tp": "two"}, "layout: expected an object of degree name (dp_replicate, dp_shard, tp, cp, pp) -> "
                              "integer 1..2^20"),
    ("layout.dp_shard", 1000, "layout: expected degrees whose product is world_size (1)"),  # accepted before
    ("layout.ep", 1, "layout: expected an object of degree name (dp_replicate"),
    ("foo", 1, "foo: expected no such key (known: step, tokens"),  # silently accepted before
    ("sampler.foo", 1, "sampler.foo: expected no such key (known: samples_seen"),
    ("sampler.cursor.nosuch", 0, "sampler.epoch: expected the sources of sampler.cursor (['email', 'json', 'nosuch'])"),
    ("sampler.stage_total", 10**12, "sampler.stage_total: expected at most samples_seen (24)"),  # accepted before
    ("sampler.stage_drawn.email", 0, "sampler.stage_drawn: expected counts summing to stage_total (24)"),
    ("data", 5, "data: expected an object of source name -> fingerprint string"),
    ("sampler", [], "sampler: expected an object"),
    ("sampler.samples_seen", "x", "sampler.samples_seen: expected an integer >= 0"),
    ("sampler.cursor", {"email": -5, "json": 0}, "sampler.cursor: expected an object of source name -> integer"),
    ("sampler.epoch", None, "sampler.epoch: expected an object of source name -> integer"),
    ("sampler.shuffle_seed", 2**70, "sampler.shuffle_seed: expected null or an integer"),
    ("sampler.cursor", _DELETE, "sampler: expected samples_seen and cursor"),
    ("watchers", [], "watchers: expected an object of watcher name -> object"),
    ("watchers.guard", {"history": "abc", "spikes": []}, "watchers.guard.history: expected a list of numbers"),
    ("watchers.guard", {"history": [], "spikes": {"a": 1}}, "watchers.guard.spikes: expected a list of step indices"),
    ("watchers.updates.history", [-1, 1e308], "watchers.updates.history: expected a list of numbers 0..1e12"),
    ("watchers.guard.history", [1e308] * 100_000, "watchers.guard.history: expected a list of numbers 0..1e12"),
    ("raw", '{"step": 3, "tokens": NaN}', "not JSON (ValueError: NaN is not JSON"),
    ("raw", '{"step": 3', "not JSON (JSONDecodeError"),
    ("raw", "[" * 100_000 + "]" * 100_000, "not JSON (RecursionError"),
]


@pytest.mark.parametrize("key,value,words", TRAINER_STATE_CASES, ids=[f"{c[0]}-{i}" for i, c in
                                                                     enumerate(TRAINER_STATE_CASES)])
def test_crafted_trainer_state_is_one_line_naming_the_key(stopped_run, tmp_path, key, value, words):
    ckpt = tmp_path / "step_00000003"
    shutil.copytree(stopped_run[0] / "checkpoints" / "step_00000003", ckpt)
    path = ckpt / "trainer_state.json"
    if key == "raw":
        path.write_text(value)
    else:
        state = json.loads(path.read_text())
        state = value if key == "" else state
        if key:
            _set(state, key, value)
        path.write_text(json.dumps(state))
    forge_marker(ckpt)
    with pytest.raises(CheckpointReadError) as e:
        read_trainer_state(ckpt)
    assert str(e.value).startswith(f"{path}: ") and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_crafted_trainer_state_through_the_commands(stopped_run, tmp_path, capsys):
    run, ckpts = _copy(stopped_run, tmp_path)
    for c in ckpts:
        state = json.loads((c / "trainer_state.json").read_text())
        state["sampler"]["samples_seen"] = -4  # a traceback deep in the sampler before, or a wrong batch
        (c / "trainer_state.json").write_text(json.dumps(state))
        forge_marker(c)
    where = f"{ckpts[1]}/trainer_state.json: sampler.samples_seen: expected an integer >= 0"
    assert where in _one_line(capsys, ["blame", str(run), "3"])
    assert where in _one_line(capsys, ["eval", str(ckpts[1])])
    # resume: no checkpoint loads (each said in one line), so it stops in one line naming the last one tried.
    err = _one_line(capsys, ["train", "--resume", str(run)])
    assert "no checkpoint could be loaded" in err and "sampler.samples_seen" in err, err


# (values of a rollback event to checkpoint 2, words of the line); blame of step 3 replays them
EVENT_CASES = [
    ({"action": "rollback", "values": {"from_step": 10**9}}, "from_step: expected an integer in 3..4"),  # hung
    ({"action": "rollback", "values": {"from_step": "5"}}, "from_step: expected an integer in 3..4"),
    ({"action": "rollback", "values": {}}, "from_step: expected an integer in 3..4"),
    ({"action": "rollback", "values": [1, 2]}, "values: expected an object"),
    ({"action": "skip_data", "values": {"skipped_samples": [0]}}, "skipped_samples: expected [first, last]"),
    ({"action": "skip_data", "values": {"skipped_samples": [0, 10**12]}}, "skipped_samples: expected [first, last]"),
    ({"action": "skip_data", "values": {"skipped_samples": [5, "x"]}}, "skipped_samples: expected [first, last]"),
]


def test_crafted_rollback_events_are_one_line_in_blame(stopped_run, tmp_path, capsys):
    run, _ = _copy(stopped_run, tmp_path)
    honest = (run / "events.jsonl").read_text()
    for extra, words in EVENT_CASES:
        event = {"kind": "rollback", "step": 2, "rank": 0, "time": time.time(), "text": "crafted", **extra}
        (run / "events.jsonl").write_text(honest + json.dumps(event) + "\n")
        err = _one_line(capsys, ["blame", str(run), "3"])
        assert f"{run}/events.jsonl: rollback event at step 2: " in err and words in err, (extra, err)
    # Lines that are JSON but no event, or an event with a time that is no number: passed over, ordered first.
    (run / "events.jsonl").write_text(honest + '[1, 2]\n5\n{"kind": "note", "time": "soon"}\n')
    assert main(["blame", str(run), "3"]) == 0


def test_metadata_cannot_point_reads_outside_the_checkpoint(stopped_run, tmp_path, capsys):
    run, ckpts = _copy(stopped_run, tmp_path)
    ckpt = ckpts[-1]
    outside = tmp_path / "elsewhere.distcp"  # a readable file outside: before, eval read the weights from it
    shutil.copy(ckpt / "__0_0.distcp", outside)
    md = read_metadata(ckpt)
    for info in md.storage_data.values():
        info.relative_path = "../../../elsewhere.distcp"
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    (ckpt / "__0_0.distcp").unlink()
    forge_marker(ckpt)
    for argv in (["eval", str(ckpt)], ["export", str(ckpt), "--format", "hf", str(tmp_path / "hf")]):
        err = _one_line(capsys, argv)
        assert f"{ckpt}/.metadata: refused: a storage entry points at '../../../elsewhere.distcp'" in err, err
    for info in md.storage_data.values():
        info.relative_path = str(outside)  # an absolute path
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    forge_marker(ckpt)
    assert "refused: a storage entry points at" in _one_line(capsys, ["eval", str(ckpt)])


def test_blame_refuses_shards_other_than_the_step_was_trained_on(stopped_run, tmp_path, capsys):
    run, ckpts = _copy(stopped_run, tmp_path)
    assert main(["blame", str(run), "3"]) == 0
    capsys.readouterr()
    # The checkpoint after step 3 records the shards it trained on; now they differ (as after a re-prepare).
    state = json.loads((ckpts[-1] / "trainer_state.json").read_text())
    state["data"]["email"] = "0123456789abcdef"
    (ckpts[-1] / "trainer_state.json").write_text(json.dumps(state))
    forge_marker(ckpts[-1])
    err = _one_line(capsys, ["blame", str(run), "3"])
    assert "the train shards of ['email'] differ from those step 3 was trained on (recorded in step_00000003)" in err
    # Step 2's batch: the checkpoint after it is step_00000002, whose record still matches.
    assert main(["blame", str(run), "2"]) == 0


def test_eval_and_export_say_the_newer_checkpoints_they_pass_over(stopped_run, tmp_path, capsys):
    run, ckpts = _copy(stopped_run, tmp_path)
    (ckpts[-1] / "COMPLETE").unlink()  # before: step 2 was evaluated and exported without a word
    (run / "checkpoints" / "step_00000008.tmp").mkdir()
    for argv, doing in ((["eval", str(run)], "evaluating"),
                        (["export", str(run), "--format", "hf", str(tmp_path / "hf")], "exporting")):
        assert main(argv) == 0, argv
        err = capsys.readouterr().err
        assert err.count("passed over") == 2, err
        assert (f"densetrain: warning: passed over {ckpts[-1]}: no completion marker (a save that did not finish, "
                f"or a damaged checkpoint); {doing} step_00000002") in err, err
        assert f"passed over {run}/checkpoints/step_00000008.tmp: a partial save" in err, err


def test_a_resume_on_fewer_processes_says_the_layouts_as_they_are(stopped_run, tmp_path, capsys):
    # A --parallel.dp_shard=2 run (FSDP2 over 2 ranks) resumed on 1 process. The checkpoint's record says so (DCP's
    # files load at any layout); before, the line said "HSDP: shard groups of 2, replicas all" of the config.
    run, ckpts = _copy(stopped_run, tmp_path)
    toml = run / "config.toml"
    toml.write_text(toml.read_text().replace("[parallel]\ndp_replicate = -1\ndp_shard = 1\n",
                                             "[parallel]\ndp_replicate = -1\ndp_shard = 2\n"))
    state = json.loads((ckpts[-1] / "trainer_state.json").read_text())
    state["world_size"], state["layout"]["dp_shard"] = 2, 2
    (ckpts[-1] / "trainer_state.json").write_text(json.dumps(state))
    forge_marker(ckpts[-1])
    assert main(["train", "--resume", str(run)]) == 0
    line = ("layout on 1 process(es): dp_replicate=1 dp_shard=1 tp=1: one process, no parallelism (checkpoint written "
            "on 2 process(es) as dp_replicate=1 dp_shard=2 tp=1: FSDP2: fully_shard over 2 data-parallel ranks); the "
            "configured dp_replicate=-1 dp_shard=2 tp=1 does not fit 1 process(es): the layout closest to it that runs")
    assert f"[step 3] {line}" in capsys.readouterr().out
    assert [e["text"] for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
            if e.get("kind") == "layout"] == [line]


def _add_source(state: dict) -> None:
    for key in ("cursor", "epoch", "window", "grid", "stage_drawn"):
        state["sampler"][key]["nosuch"] = 0


# (key, crafted value, words): each consistent on its own (dcp_read's schema passes it), wrong for this run's config
RESUME_CASES = [
    ("sampler.grid.email", 10**9, "sampler.grid.email: expected 0 or a stage's seq_len ([32]), got 1000000000"),
    ("sampler.grid.email", 0, "sampler.window.email: expected 0 while sampler.grid.email is 0"),
    ("sampler.window.email", 10**9, "sampler.window.email: expected at most the "),
    ("sampler.cursor.email", 10**12, "sampler.cursor.email: expected a token offset 0.."),
    ("sampler.stage", "nope", "sampler.stage: expected null or a stage name (['main']), got 'nope'"),
    ("stage", "nope", "stage: expected '' or a stage name (['main']), got 'nope'"),
    ("", _add_source, "sampler.cursor.nosuch: expected a source of this run (['email', 'json'])"),
    ("watchers.guard.history", [6.0] * 1000, "watchers.guard.history: expected at most guard.window ("),
    ("watchers.guard.spikes", [1] * 1000, "watchers.guard.spikes: expected at most guard.window ("),
    ("watchers.updates.history", [300.0] * 1000, "watchers.updates.history: expected at most guard.window ("),
]


def test_a_trainer_state_wrong_for_the_run_is_refused_on_resume(stopped_run, tmp_path, capsys):
    # Each was resumed silently before (a grid of 10^9 even changed the data trained: "window length 1000000000
    # -> 32; epoch 0 ends after 12 of 0 windows").
    run, ckpts = _copy(stopped_run, tmp_path)
    path = ckpts[-1] / "trainer_state.json"
    honest = path.read_text()
    for key, value, words in RESUME_CASES:
        state = json.loads(honest)
        value(state) if callable(value) else _set(state, key, value)
        path.write_text(json.dumps(state))
        forge_marker(ckpts[-1])
        err = _one_line(capsys, ["train", "--resume", str(run)])
        assert err.startswith(f"densetrain: error: {path}: {words}"), (key, err)
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] <= 3  # nothing trained
