"""Console wording of small reports: blame's document location, the optimizer-groups start-up line."""

from __future__ import annotations

import torch

from densetrain.optim import describe_groups
from densetrain.tools.blame import format_blame


def test_blame_names_a_text_document_by_its_file_and_a_jsonl_one_by_file_and_line():
    docs = [{"source": "stdlib", "file": "email/parser.py", "line": None, "doc_id": 7, "tokens": 12},
            {"source": "web", "file": "web/00.jsonl", "line": 41, "doc_id": 8, "tokens": 52}]
    text = format_blame({"step": 3, "stage": 0, "sample_index": 16, "samples": [{"index": 16, "documents": docs}]})
    lines = text.splitlines()
    assert " email/parser.py  id=7 " in lines[1] and "None" not in text
    assert " web/00.jsonl:41  id=8 " in lines[2]


def test_optimizer_groups_line_counts_one_tensor_in_the_singular():
    one, two = torch.nn.Parameter(torch.zeros(3)), [torch.nn.Parameter(torch.zeros(2, 4)) for _ in range(2)]
    opt = torch.optim.AdamW([{"params": [one], "weight_decay": 0.0}, {"params": two, "weight_decay": 0.1}], lr=1e-3)
    text, values = describe_groups(opt, peak_lr=1e-3)
    assert text.startswith("AdamW: 1 tensor, 0.00M params (3 x1), peak lr 0.001, weight_decay 0; "
                           "AdamW: 2 tensors, 0.00M params (2x4 x2)"), text
    assert [v["tensors"] for v in values] == [1, 2]
