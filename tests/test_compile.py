"""torch.compile of the model: one compile per input shape (the RoPE tables and the document mask are
built inside the graph, no buffer reassigned, no host copy), the same logits as eager."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounter

from densetrain.config import ModelConfig
from densetrain.model.llama import Transformer


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64))


def _doc_ids(T: int, cut: int) -> torch.Tensor:
    doc = torch.zeros(2, T, dtype=torch.long)
    doc[0, cut:] = 1
    doc[1, T - cut:] = 1
    return doc


def test_one_compile_per_shape_and_eager_logits():
    torch._dynamo.reset()
    model, cnt = _model(), CompileCounter()
    compiled = torch.compile(model, backend=cnt)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(3):
            got = compiled(x)
        assert cnt.frame_count == 1  # before: 2 (the first call reassigned the empty RoPE buffers)
        assert torch.allclose(got, model(x), rtol=1e-5, atol=1e-6)
        model.set_rope(5e5, model.rope_scaling)  # a long-context stage: new base and a longer sequence
        x2 = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(2))
        for _ in range(3):
            got = compiled(x2)
        assert cnt.frame_count == 2  # before: 4
        assert torch.allclose(got, model(x2), rtol=1e-5, atol=1e-6)


def test_document_mask_compiles_once_for_every_document_layout():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, cnt = _model(), CompileCounter()
    compiled = torch.compile(model, backend=cnt)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for cut in (4, 9, 12):  # other document boundaries each batch
            got = compiled(x, doc_ids=_doc_ids(16, cut))
            assert torch.allclose(got, model(x, doc_ids=_doc_ids(16, cut)), rtol=1e-5, atol=1e-6)
    # before: a graph break at the host copy of the document ids and a graph per document layout
    assert cnt.frame_count == 1
    assert torch._dynamo.utils.counters["graph_break"] == {}


def test_compiled_blocks_do_not_recompile_per_number_of_documents():
    # parallel.compile_blocks compiles each block; the mask's per-document spans (host lists) were specialised
    # on: a recompile per number of documents in a row, 8 in the 10 batches below, then torch's limit (eager)
    torch._dynamo.reset()
    model, eager, cnt = _model(), _model(), CompileCounter()
    for block in model.layers:
        block.compile(backend=cnt)
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 64, (2, 16), generator=g)
    with torch.no_grad():
        for _ in range(10):
            eos = (torch.rand(2, 16, generator=g) < 0.25).long()
            doc = torch.cumsum(eos, dim=1) - eos  # (2, 16): 1 to ~8 documents per row
            assert torch.allclose(model(x, doc_ids=doc), eager(x, doc_ids=doc), rtol=1e-5, atol=1e-6)
    assert cnt.frame_count == 1
