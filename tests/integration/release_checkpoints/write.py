"""Write the checkpoints that tests/integration/test_release_checkpoints.py loads: tiny models patched with kernels
whose state exercises every saved part (feature-map parameters, window + sinks + sparse cache, delta rule, gates,
an encoder), each saved with ``save_pretrained`` by the release being recorded, with its logits and greedy
continuation on a fixed prompt as computed by that release.

    PYTHONPATH=<checkout of the release> python tests/integration/release_checkpoints/write.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

import hf_kernel_attn

CAUSAL = {
    "hedgehog-window-sinks-sparse": ("hedgehog", {"window": 4, "sinks": 2, "sparse_cache": 4, "sparse_block": 2}),
    "gated-deltanet-window": ("gated_deltanet", {"window": 4}),
    "gla": ("gla", {}),
}
ENCODER = {"cosine-encoder": ("cosine", {})}


def _llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


def _bert() -> BertModel:
    config = BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64)
    return BertModel(config).eval()


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Kernel parameters away from their init, so a load that re-initialises them shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".kernel_attn." in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def main(out: Path) -> None:
    prompt = torch.arange(3, 3 + 24).remainder(64).unsqueeze(0)
    for seed, (name, (kernel, options)) in enumerate({**CAUSAL, **ENCODER}.items()):
        torch.manual_seed(seed)
        model = _bert() if name in ENCODER else _llama()
        hf_kernel_attn.patch(model, kernel, **options)
        _perturb(model, seed)
        folder = out / name
        model.save_pretrained(folder)
        record = {"kernel": kernel, "options": options, "release": hf_kernel_attn.__version__}
        with torch.no_grad():
            if name in ENCODER:
                save_file({"hidden": model(prompt).last_hidden_state.contiguous()}, folder / "expected.safetensors")
            else:
                logits = model(prompt).logits
                tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)
                expected = {"logits": logits.contiguous(), "tokens": tokens.contiguous()}
                save_file(expected, folder / "expected.safetensors")
        (folder / "record.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
