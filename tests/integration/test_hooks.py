"""The hooks on transformers are undone exactly: every replaced class attribute goes back to the object transformers
defined (identity, read before hf_kernel_attn was imported, in a fresh interpreter), the registration finder leaves
``sys.meta_path`` as it found it, and ``unpatch`` leaves a model as it was before ``patch``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_kernel_attn

CLASS_HOOKS = textwrap.dedent("""
    import json, sys
    import transformers.modeling_utils as mu
    from transformers.generation.utils import GenerationMixin
    owners = {"PreTrainedModel": mu.PreTrainedModel, "GenerationMixin": GenerationMixin}
    before = {o: dict(vars(c)) for o, c in owners.items()}          # transformers as it defines itself
    import hf_kernel_attn
    from hf_kernel_attn import _registration
    from hf_kernel_attn.integration import hooks
    _registration.activate()
    changed = {o: sorted(k for k in set(before[o]) | set(vars(c)) if before[o].get(k) is not vars(c).get(k))
               for o, c in owners.items()}
    table = sorted(f"{p.owner.__name__}.{p.name}" for p in hooks.PATCHES)
    hooks.remove_hooks()
    left = {o: sorted(k for k in set(before[o]) | set(vars(c)) if before[o].get(k) is not vars(c).get(k))
            for o, c in owners.items()}
    hooks.install_hooks()
    again = {o: sorted(k for k in set(before[o]) | set(vars(c)) if before[o].get(k) is not vars(c).get(k))
             for o, c in owners.items()}
    print(json.dumps({"changed": changed, "table": table, "left": left, "again": again}))
""")

META_PATH = textwrap.dedent("""
    import json, sys
    import hf_kernel_attn
    from hf_kernel_attn import _registration
    armed = _registration.is_armed()
    import transformers.modeling_utils  # the finder fires here, activates, and takes itself off
    after = [type(f).__qualname__ for f in sys.meta_path]
    print(json.dumps({"armed": armed, "active": _registration.is_active(), "after": after}))
""")
# the reference: the finders the same imports leave without hf_kernel_attn (transformers and torch add their own)
META_PATH_STOCK = textwrap.dedent("""
    import json, sys
    import transformers.modeling_utils
    import hf_kernel_attn  # imported after: nothing to arm
    print(json.dumps({"after": [type(f).__qualname__ for f in sys.meta_path]}))
""")


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_class_hook_is_in_the_table_and_removed():
    got = _run(CLASS_HOOKS)
    changed = sorted(f"{owner}.{name}" for owner, names in got["changed"].items() for name in names)
    assert changed == got["table"], "a class attribute changed that the table does not list (or the reverse)"
    assert "PreTrainedModel.post_init" in changed and "GenerationMixin._prepare_cache_for_generation" in changed
    assert got["left"] == {"PreTrainedModel": [], "GenerationMixin": []}, "remove_hooks left a replacement behind"
    assert sorted(f"{o}.{n}" for o, names in got["again"].items() for n in names) == changed


def test_registration_finder_leaves_meta_path_as_it_found_it():
    got = _run(META_PATH)
    assert got["armed"] and got["active"]
    assert got["after"] == _run(META_PATH_STOCK)["after"]


def _model_state(model: torch.nn.Module) -> dict:
    return {
        "modules": [name for name, _ in model.named_modules()],
        "parameters": sorted(model.state_dict()),
        "pre_hooks": {name: [id(h) for h in m._forward_pre_hooks.values()] for name, m in model.named_modules()},
        "hooks": {name: [id(h) for h in m._forward_hooks.values()] for name, m in model.named_modules()},
        "config": model.config.to_dict(),
        "attn": model.config._attn_implementation,
    }


def test_unpatch_undoes_every_model_change():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    x = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        reference = model(x).logits
    before = _model_state(model)
    hf_kernel_attn.patch(model, "hedgehog", window=4, sinks=2)
    patched = _model_state(model)
    assert patched["pre_hooks"] != before["pre_hooks"] and patched["modules"] != before["modules"]
    with torch.no_grad():
        model.generate(x, max_new_tokens=3, do_sample=False)
    hf_kernel_attn.unpatch(model)
    assert _model_state(model) == before
    with torch.no_grad():
        assert torch.equal(model(x).logits, reference)
