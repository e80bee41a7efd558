"""Checkpoint round trips (tied weights, optimizer state, RNG), completion marker, retention."""

import shutil

import torch

from densetrain.checkpoint import latest_checkpoint, list_complete, load_checkpoint, mirror, save_checkpoint
from densetrain.config import load_config
from densetrain.model.init import build_model
from densetrain.optim import build_optimizer


def _setup(tied: bool):
    cfg = load_config("tiny", overrides=[("model.vocab_size", 300), ("model.d_model", 32), ("model.n_layers", 2),
                                         ("model.n_heads", 4), ("model.n_kv_heads", 2), ("model.d_ff", 64),
                                         ("model.tie_embeddings", tied)])
    model = build_model(cfg.model, cfg.train.seed, torch.device("cpu"))
    opt = build_optimizer(model, cfg)
    for g in opt.param_groups:
        g["lr"] = 1e-2
    x = torch.randint(0, 300, (2, 16))
    model(x).logsumexp(-1).mean().backward()
    opt.step()
    opt.zero_grad()
    return cfg, model, opt


def test_round_trip_with_tied_embeddings(tmp_path):
    cfg, model, opt = _setup(tied=True)
    torch.manual_seed(123)
    save_checkpoint(tmp_path, 7, model, opt, {"step": 7, "tokens": 99}, keep=2)
    expected_rand = torch.rand(3)

    cfg2, fresh, fresh_opt = _setup(tied=True)
    fresh.tok_embeddings.weight.data.zero_()
    state = load_checkpoint(latest_checkpoint(tmp_path), fresh, fresh_opt)
    assert state == {"step": 7, "tokens": 99}
    assert fresh.output.weight is fresh.tok_embeddings.weight  # still tied after loading
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), n
    sa, sb = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"])
    assert torch.equal(torch.rand(3), expected_rand)  # RNG state restored


def test_incomplete_checkpoints_are_ignored_and_retention(tmp_path):
    cfg, model, opt = _setup(tied=False)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, opt, {"step": step}, keep=2)
    assert [s for s, _ in list_complete(tmp_path)] == [3, 4]
    # A killed write: a .tmp directory, and a directory whose COMPLETE marker never landed.
    shutil.copytree(tmp_path / "checkpoints" / "step_00000004", tmp_path / "checkpoints" / "step_00000005.tmp")
    shutil.copytree(tmp_path / "checkpoints" / "step_00000004", tmp_path / "checkpoints" / "step_00000006")
    (tmp_path / "checkpoints" / "step_00000006" / "COMPLETE").unlink()
    assert latest_checkpoint(tmp_path).name == "step_00000004"
    # Saving step 5 again replaces the stale temporary directory.
    save_checkpoint(tmp_path, 5, model, opt, {"step": 5}, keep=2)
    assert latest_checkpoint(tmp_path).name == "step_00000005"
    assert not (tmp_path / "checkpoints" / "step_00000005.tmp").exists()


def test_optimizer_state_of_a_parameter_without_gradient_yet_loads(tmp_path):
    """AdamW keeps no state for a parameter that never had a gradient (here the final norm): such a
    checkpoint loads (it failed with 'Missing key optim.state.norm.weight.step'), the saved moments come
    back exactly, and the next step of the resumed optimizer equals the uninterrupted one."""
    cfg = load_config("tiny", overrides=[("model.vocab_size", 300), ("model.d_model", 32), ("model.n_layers", 2),
                                         ("model.n_heads", 4), ("model.n_kv_heads", 2), ("model.d_ff", 64)])

    def grads(m, seed):
        m(torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(seed))).logsumexp(-1).mean().backward()
        m.norm.weight.grad = None  # no gradient yet: AdamW makes no state for it

    model = build_model(cfg.model, cfg.train.seed, torch.device("cpu"))
    opt = build_optimizer(model, cfg)
    grads(model, 0)
    opt.step()
    opt.zero_grad()
    assert model.norm.weight not in opt.state and len(opt.state) == len(list(model.parameters())) - 1
    save_checkpoint(tmp_path, 1, model, opt, {"step": 1})

    fresh = build_model(cfg.model, cfg.train.seed + 1, torch.device("cpu"))
    fresh_opt = build_optimizer(fresh, cfg)
    load_checkpoint(latest_checkpoint(tmp_path), fresh, fresh_opt)
    names = {id(p): n for n, p in model.named_parameters()}
    fresh_params = dict(fresh.named_parameters())
    for p, st in opt.state.items():
        got = fresh_opt.state[fresh_params[names[id(p)]]]
        assert torch.equal(got["exp_avg"], st["exp_avg"]) and torch.equal(got["step"], st["step"]), names[id(p)]
    for m, o in ((model, opt), (fresh, fresh_opt)):  # one more step on both: the same parameters after it
        grads(m, 1)
        m.norm.weight.grad = torch.ones_like(m.norm.weight)  # its first gradient: fresh state either way
        o.step()
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_store_retention_counts_the_stores_complete_checkpoints_not_the_run_directorys(tmp_path):
    """A run resumed on a new machine fetches only the newest checkpoint from ``checkpoint.dir``; its next upload
    deleted every older one there (even with ``keep = 0``, keep all), since retention counted the local list.
    The store keeps its newest ``keep`` complete checkpoints, whatever the run directory holds."""
    _, model, opt = _setup(tied=False)
    store, first, second = tmp_path / "store", tmp_path / "machine_a", tmp_path / "machine_b"
    for step in (1, 2, 3):
        save_checkpoint(first, step, model, opt, {"step": step}, keep=0)
    mirror.sync_up(first, store, keep=0)
    assert [s for s, _ in mirror.remote_complete(store)] == [1, 2, 3]
    assert mirror.fetch_newest(second, store) == "step_00000003"  # the new machine: only the newest comes back
    save_checkpoint(second, 4, model, opt, {"step": 4}, keep=0)
    mirror.sync_up(second, store, keep=0)
    assert [s for s, _ in mirror.remote_complete(store)] == [1, 2, 3, 4]  # was [3, 4]
    save_checkpoint(second, 5, model, opt, {"step": 5}, keep=3)
    mirror.sync_up(second, store, keep=3)
    assert [s for s, _ in mirror.remote_complete(store)] == [3, 4, 5]
    assert [s for s, _ in list_complete(second)] == [3, 4, 5]
