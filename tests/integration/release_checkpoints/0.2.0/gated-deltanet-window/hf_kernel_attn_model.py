"""Written by hf_kernel_attn: this model's attention runs hf_kernel_attn kernels (config.kernel_attention).

Loading it with trust_remote_code=True runs this file, which imports exactly:
* hf_kernel_attn (the plugin, which must be installed): it registers its built-in kernels with
  transformers and wraps a few transformers methods for the whole process, listed in its
  docs/security.md; it imports no module that a checkpoint names;
* transformers.
The classes below are the stock transformers classes under names that transformers' auto classes can map."""

try:
    import hf_kernel_attn  # noqa: F401  registers the kernels and attaches them when the model is built
    from hf_kernel_attn.kernels import KERNELS as _REGISTERED
except ImportError as exc:
    raise ImportError(
        "this model runs an hf_kernel_attn attention kernel (config.kernel_attention); install the plugin: "
        "pip install hf_kernel_attn"
    ) from exc

import transformers


class KernelAttnLlamaForCausalLM(transformers.LlamaForCausalLM):
    pass


class KernelAttnLlamaForQuestionAnswering(transformers.LlamaForQuestionAnswering):
    pass


class KernelAttnLlamaForSequenceClassification(transformers.LlamaForSequenceClassification):
    pass


class KernelAttnLlamaForTokenClassification(transformers.LlamaForTokenClassification):
    pass


class KernelAttnLlamaModel(transformers.LlamaModel):
    pass
