"""Exports a user can load: `from_pretrained` finds exactly the trainer's weights."""

import json
import subprocess
import sys

import pytest
import torch

from rl_async.state.hf_export import export_checkpoint, export_hf
from rl_async.train.torch_trainer import TorchTrainer, TorchTrainerConfig
from test_torch_trainer import TINY, make_groups, set_behavior_from

torch.set_num_threads(1)


def trained(hf_config):
    trainer = TorchTrainer(TorchTrainerConfig(hf_config=hf_config, lr=1e-2, global_batch_size=8,
                                              micro_batch_size=4, device="cpu"))
    groups = make_groups()
    set_behavior_from(trainer, groups)
    trainer.train_collection(groups, 0)  # moved away from the initial weights
    return trainer


def load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True)


def assert_same_weights(model, trainer, dtype=torch.float32):
    theirs = dict(model.state_dict())
    ours = dict(trainer.model.state_dict())
    assert set(theirs) == set(ours)
    for name, t in ours.items():
        assert torch.equal(theirs[name], t.to(dtype)), name


@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_with_exactly_the_trainers_weights(tmp_path, tied):
    trainer = trained({**TINY, "tie_word_embeddings": tied})
    out = export_hf(trainer.named_tensors_for_publication(), tmp_path / "hf",
                    hf_config={**TINY, "tie_word_embeddings": tied})
    model = load(out)
    assert_same_weights(model, trainer)
    assert model.config.tie_word_embeddings is tied
    assert (out / "generation_config.json").is_file() and not (tmp_path / "hf.tmp").exists()


def test_sharded_export_and_bf16(tmp_path):
    trainer = trained(TINY)
    out = export_hf(trainer.named_tensors_for_publication(), tmp_path / "hf", hf_config=TINY,
                    dtype="bfloat16", shard_bytes=4096)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = load(out)
    assert model.dtype == torch.bfloat16
    assert_same_weights(model, trainer, torch.bfloat16)


def test_export_cli_rebuilds_an_older_checkpoint(tmp_path):
    trainer = trained(TINY)
    trainer.save_checkpoint(tmp_path / "ckpt")  # trainer state only, no hf/ export
    proc = subprocess.run([sys.executable, "-m", "launch.cli", "export", str(tmp_path / "ckpt"),
                           str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert_same_weights(load(tmp_path / "out"), trainer)
    # A checkpoint with its export is copied as it is.
    export_hf(trainer.named_tensors_for_publication(), tmp_path / "ckpt" / "hf", hf_config=TINY)
    assert_same_weights(load(export_checkpoint(tmp_path / "ckpt", tmp_path / "out2")), trainer)
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "out3")
