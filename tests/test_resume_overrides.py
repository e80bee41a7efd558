"""A ``--resume`` with an override that the run cannot take is refused in one line and changes nothing.

Before: the refused override was already written into RUN/config.toml (saved before the checkpoint's sampler state
was checked), so every later plain ``--resume`` failed on it too; and another ``train.seed`` or ``data.shuffle``
passed every check, then ended at the first step in a bare ``ValueError`` traceback from the sampler.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from test_resume import trajectory

from densetrain.cli import main
from densetrain.data.mixture import MixtureSampler
from densetrain.data.streams import open_streams
from densetrain.errors import ConfigError
from densetrain.train import train

SEED_0 = "shuffled with train.seed 0"
# (flag, the refusal's text after 'densetrain: error: '): each one refused by a check that runs after the model
# loads (the checkpoint's sampler grid; the data order; the eval task names).
REFUSED = [
    ("--train.seq_len=128", "trainer_state.json: sampler.grid.email: expected 0 or a stage's seq_len ([128]), got 32"),
    ("--train.seed=5", f"train.seed: the run's data was drawn {SEED_0}, this config draws shuffled with train.seed "
                       "5; a run keeps its data order: resume without changing train.seed, or start a new run "
                       "(another --train.run_dir) to use it"),
    ("--data.shuffle=false", f"data.shuffle: the run's data was drawn {SEED_0}, this config draws in file order "
                             "(data.shuffle = false); a run keeps its data order: resume without changing "
                             "data.shuffle, or start a new run (another --train.run_dir) to use it"),
    ("--eval.tasks=no_such_task", "no_such_task"),
]


def test_refused_overrides_leave_config_toml_and_a_plain_resume_continues_bitwise(stopped_run, tmp_path, capsys):
    src, cfg = stopped_run
    ref = tmp_path / "ref"
    train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=str(ref))))  # uninterrupted
    run = Path(shutil.copytree(src, tmp_path / "run"))
    before = (run / "config.toml").read_bytes()
    capsys.readouterr()
    for flag, said in REFUSED:
        assert main(["train", "--resume", str(run), flag]) == 2, flag
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("densetrain: error: ") and said in err[0], (flag, err)
        assert (run / "config.toml").read_bytes() == before, f"{flag} was written into config.toml"
    assert main(["train", "--resume", str(run)]) == 0
    assert trajectory(run) == trajectory(ref)  # steps 1..4, the resumed 4th bit for bit the uninterrupted one's
    assert sorted(trajectory(run)) == [1, 2, 3, 4]


@pytest.mark.parametrize(("drawn", "now", "key", "words"), [
    (0, 5, "train.seed", ("shuffled with train.seed 0", "shuffled with train.seed 5")),
    (0, None, "data.shuffle", ("shuffled with train.seed 0", "in file order (data.shuffle = false)")),
    (None, 7, "data.shuffle", ("in file order (data.shuffle = false)", "shuffled with train.seed 7")),
])
def test_the_sampler_refuses_another_order_once_it_has_drawn(prepared, tmp_path, drawn, now, key, words):
    _, make = prepared
    streams = open_streams(make(tmp_path), "train")
    sampler = MixtureSampler(streams)
    sampler.next_samples(4, "main", {"email": 0.5, "json": 0.5}, 32, shuffle_seed=drawn)
    state = sampler.state_dict()
    with pytest.raises(ConfigError) as e:
        MixtureSampler(streams).load_state_dict(state, shuffle_seed=now)
    assert str(e.value).startswith(f"{key}: the run's data was drawn {words[0]}, this config draws {words[1]};")
    MixtureSampler(streams).load_state_dict(state, shuffle_seed=drawn)  # the run's own order: taken
    fresh = MixtureSampler(streams).state_dict()  # nothing drawn yet (a step-0 state): any order may start
    MixtureSampler(streams).load_state_dict(fresh, shuffle_seed=now)
