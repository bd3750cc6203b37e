"""A training task defined outside the package, through the public API only (``register_task``): twice the causal
LM loss. tests/training/test_training.py names this module under a config's ``imports:``, run through the CLI."""

from hf_kernel_attn.training import register_task
from hf_kernel_attn.training.tasks.causal_lm import CausalLMTask


@register_task
class DoubleLM(CausalLMTask):
    name = "double_lm_cli"

    def loss(self, model, batch):
        return 2 * super().loss(model, batch)
