"""The one registry (hf_kernel_attn/registry.py) and its one policy, generic and through the four registries'
public functions: kernels (``register_kernel``), long-context tasks, training tasks and training stages; and a
stage of one's own that a training config's ``imports:`` registers (tests/custom_stage.py)."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import yaml

import hf_kernel_attn
from hf_kernel_attn.evaluation.long_context import TASKS, LongContextTask
from hf_kernel_attn.evaluation.long_context import register_task as register_long_task
from hf_kernel_attn.kernels import KERNELS, kernel_class
from hf_kernel_attn.registry import Registry, UnknownNameError, describe
from hf_kernel_attn.training import ConfigError, TrainingStage, TrainingTask, load_config, register_stage, register_task
from hf_kernel_attn.training.stages import COMMON_DEFAULTS, STAGE_TYPES, stage_names
from hf_kernel_attn.training.tasks import TASK_TYPES
from tests.training.helpers import lm_config, read_log, write_config


class Base:
    pass


class A(Base):
    pass


class B(Base):
    pass


def _make():
    """A class of the same module:qualname each call: the same definition executed again."""

    class Again(Base):
        pass

    return Again


# ------------------------------------------------------------------------------------------ generic registry
def test_register_get_and_the_mapping_view():
    reg: Registry[type[Base]] = Registry("widget", Base)
    assert reg.register("b", B) is B
    assert reg.register("a")(A) is A  # the decorator form
    assert reg.get("a") is A and reg["b"] is B
    assert reg.names() == ["a", "b"] and list(reg) == ["b", "a"]  # sorted; registration order
    assert len(reg) == 2 and "a" in reg and "c" not in reg and ["a"] not in reg  # unhashable: not a name
    assert reg.items() == [("b", B), ("a", A)]
    assert reg.pop("b") is B and reg.pop("b", None) is None and reg.names() == ["a"]


def test_same_object_again_is_a_no_op():
    reg: Registry[type[Base]] = Registry("widget", Base)
    reg.register("a", A)
    assert reg.register("a", A) is A and reg.items() == [("a", A)]


def test_the_same_definition_again_replaces_the_old_object():
    reg: Registry[type[Base]] = Registry("widget", Base)
    first, second = _make(), _make()
    assert first is not second and describe(first) == describe(second)
    reg.register("x", first)
    reg.register("x", second)  # a module executed again (importlib.reload, a notebook cell run twice)
    assert reg.get("x") is second


def test_conflicting_duplicate_names_the_kind_the_name_and_both_objects():
    reg: Registry[type[Base]] = Registry("widget", Base)
    reg.register("a", A)
    with pytest.raises(ValueError) as err:
        reg.register("a", B)
    msg = str(err.value)
    assert "widget 'a' is already registered by tests.test_registry:A" in msg
    assert "cannot register tests.test_registry:B" in msg
    assert reg.get("a") is A  # unchanged


def test_base_class_check():
    reg: Registry[type[Base]] = Registry("widget", Base)
    with pytest.raises(TypeError, match="widget 'i': expected a subclass of tests.test_registry:Base, got <class "):
        reg.register("i", int)
    with pytest.raises(TypeError, match="expected a subclass of tests.test_registry:Base"):
        reg.register("a", A())  # an instance where classes are registered
    instances: Registry[Base] = Registry("gadget", Base, instances=True)
    a = A()
    assert instances.register("a", a) is a
    assert instances.register("a", a) is a  # the same instance again: fine
    with pytest.raises(ValueError, match="gadget 'a' is already registered by tests.test_registry:A; cannot "
                                         "register another instance of tests.test_registry:A"):
        instances.register("a", A())  # another instance of the same class is a different object
    reg.register("lazy", "tests.test_registry:A")
    assert reg.register("lazy", "tests.test_registry:A") == "tests.test_registry:A"  # an equal lazy entry: fine
    with pytest.raises(TypeError, match="gadget 'b': expected an instance of tests.test_registry:Base"):
        instances.register("b", B)
    assert Registry("anything").register("n", 3) == 3  # no base: no check
    with pytest.raises(ValueError, match="a widget name must be a non-empty string"):
        reg.register("", A)


def test_unknown_name_lists_the_valid_names():
    reg: Registry[type[Base]] = Registry("widget", Base, hint="register yours with register_widget")
    reg.register("b", B)
    reg.register("a", A)
    for get in (reg.get, reg.__getitem__):
        with pytest.raises(UnknownNameError) as err:
            get("c")
        assert str(err.value) == ("unknown widget 'c'; available widgets: ['a', 'b'] "
                                  "(register yours with register_widget)")
        assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)
    with pytest.raises(KeyError, match=r"unknown widget \['a'\]"):
        reg.get(["a"])  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="unknown widget 'c'"):
        reg.pop("c")


def test_lazy_entry_is_imported_on_first_get(tmp_path, monkeypatch):
    (tmp_path / "lazy_widgets.py").write_text("class Lazy(Exception):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg: Registry[type[Exception]] = Registry("error", Exception)
    reg.register("lazy", "lazy_widgets:Lazy")
    assert "lazy" in reg and reg.names() == ["lazy"] and "lazy_widgets" not in sys.modules
    try:
        cls = reg.get("lazy")
    finally:
        sys.modules.pop("lazy_widgets", None)
    assert cls.__module__ == "lazy_widgets" and cls.__name__ == "Lazy" and reg.get("lazy") is cls
    assert reg.register("lazy", "lazy_widgets:Lazy") == "lazy_widgets:Lazy" and reg.get("lazy") is cls  # no-op
    with pytest.raises(ValueError, match="'lazy' is already registered by lazy_widgets:Lazy; cannot register "
                                         "builtins:KeyError"):
        reg.register("lazy", KeyError)
    # a lazy entry, then the object it names (the module registering itself): the same definition
    other: Registry[type[dict]] = Registry("mapping", dict)
    other.register("od", "collections:OrderedDict")
    from collections import OrderedDict

    assert other.register("od", OrderedDict) is OrderedDict and other.items() == [("od", OrderedDict)]


def test_lazy_entry_errors_are_clear():
    reg: Registry[type[int]] = Registry("number", int)
    reg.register("wrong", "collections:OrderedDict")
    reg.register("gone", "no_such_module_for_registry_tests:Thing")
    reg.register("missing", "collections:NoSuchThing")
    with pytest.raises(TypeError, match=r"number 'wrong' \(registered as 'collections:OrderedDict'\): expected a "
                                        r"subclass of builtins:int"):
        reg.get("wrong")
    with pytest.raises(ImportError, match="number 'gone' .*cannot import module 'no_such_module_for_registry_tests'"):
        reg.get("gone")
    with pytest.raises(ImportError, match="number 'missing' .*module 'collections' has no attribute 'NoSuchThing'"):
        reg.get("missing")
    with pytest.raises(TypeError):
        reg.items()  # resolves every entry
    with pytest.raises(ValueError, match="a lazy entry is a 'module:object' string, got 'collections'"):
        reg.register("bad", "collections")


# ------------------------------------------------------------------------------------------------- kernels
def test_kernel_registry_policy():
    class Probe(hf_kernel_attn.FeatureMapKernel):
        name = "registry-probe"

        def feature_map(self, x):
            return torch.relu(x) + 0.1

    class Other(hf_kernel_attn.FeatureMapKernel):
        name = "registry-probe"

    try:
        assert hf_kernel_attn.register_kernel(Probe) is Probe
        assert hf_kernel_attn.register_kernel(Probe) is Probe  # again: fine
        assert kernel_class("registry-probe") is Probe and "registry-probe" in hf_kernel_attn.available_kernels()
        with pytest.raises(ValueError) as err:
            hf_kernel_attn.register_kernel(Other)
        assert "kernel 'registry-probe' is already registered by tests.test_registry:" in str(err.value)
        assert "test_kernel_registry_policy.<locals>.Probe" in str(err.value)
        assert "test_kernel_registry_policy.<locals>.Other" in str(err.value)
        assert kernel_class("registry-probe") is Probe
    finally:
        KERNELS.pop("registry-probe", None)
    with pytest.raises(ValueError, match=r"unknown kernel 'registry-probe'; available kernels: \['cosformer'"):
        kernel_class("registry-probe")
    with pytest.raises(KeyError, match="register it with hf_kernel_attn.register_kernel"):
        KERNELS["registry-probe"]


def test_a_reloaded_kernel_module_registers_again():
    name = "tests.custom_kernels"
    module = importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
    try:
        before = kernel_class("sqrelu")
        importlib.reload(module)  # the same definitions executed again
        assert kernel_class("sqrelu") is module.SquaredReLU is not before
    finally:
        KERNELS.pop("sqrelu", None)


# ------------------------------------------------------------------------------------- long-context tasks
def test_long_context_task_registry_policy():
    class Probe(LongContextTask):
        name = "registry_probe"
        kind = "generate"

    class Other(LongContextTask):
        name = "registry_probe"
        kind = "generate"

    class Clash(LongContextTask):
        name = "passkey"
        kind = "generate"

    passkey = TASKS["passkey"]
    try:
        assert register_long_task(Probe) is Probe and isinstance(TASKS["registry_probe"], Probe)
        assert register_long_task(Probe) is Probe  # the same class again: fine
        with pytest.raises(ValueError, match="long-context task 'registry_probe' is already registered by "
                                             "tests.test_registry:.*Probe; cannot register .*Other"):
            register_long_task(Other)
        with pytest.raises(ValueError, match="long-context task 'passkey' is already registered by "
                                             "hf_kernel_attn.evaluation.long_context.passkey:"):
            register_long_task(Clash)
        assert TASKS["passkey"] is passkey
        with pytest.raises(TypeError, match="subclass of LongContextTask"):
            register_long_task(int)  # type: ignore[arg-type]
    finally:
        TASKS.pop("registry_probe", None)
    with pytest.raises(KeyError, match=r"unknown long-context task 'nosuch'; available long-context tasks: \["):
        TASKS["nosuch"]
    assert {"passkey", "niah", "kv_recall", "position_loss"} <= set(TASKS.names())


# ----------------------------------------------------------------------------------------- training tasks
def test_training_task_registry_policy():
    class Probe(TrainingTask):
        name = "registry_probe"

    class Other(TrainingTask):
        name = "registry_probe"

    class Clash(TrainingTask):
        name = "causal_lm"

    try:
        assert register_task(Probe) is Probe and register_task(Probe) is Probe and TASK_TYPES["registry_probe"] is Probe
        with pytest.raises(ValueError, match="training task 'registry_probe' is already registered by .*Probe; "
                                             "cannot register .*Other"):
            register_task(Other)
        with pytest.raises(ValueError, match="training task 'causal_lm' is already registered by "
                                             "hf_kernel_attn.training.tasks.causal_lm:"):
            register_task(Clash)
        with pytest.raises(TypeError, match="expected a subclass of hf_kernel_attn.training.tasks.base:TrainingTask"):
            register_task(type("Loose", (), {"name": "loose"}))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="needs a class attribute `name`"):
            register_task(type("Nameless", (TrainingTask,), {}))
    finally:
        TASK_TYPES.pop("registry_probe", None)
    assert TASK_TYPES.names() == ["causal_lm", "sentence_embedding", "sequence_classification"]


# ---------------------------------------------------------------------------------------- training stages
def test_training_stage_registry_policy():
    class Probe(TrainingStage):
        name = "registry_probe"
        order = 1  # ties with distill: after it (registration order)

    class Other(TrainingStage):
        name = "registry_probe"

    class Clash(TrainingStage):
        name = "lora"

    try:
        assert register_stage(Probe) is Probe and register_stage(Probe) is Probe
        assert stage_names() == ("transfer", "distill", "registry_probe", "lora", "full", "retention")
        with pytest.raises(ValueError, match="training stage 'registry_probe' is already registered by .*Probe; "
                                             "cannot register .*Other"):
            register_stage(Other)
        with pytest.raises(ValueError, match="training stage 'lora' is already registered by "
                                             "hf_kernel_attn.training.stages.lora:LoraStage"):
            register_stage(Clash)
        with pytest.raises(TypeError, match="expected a subclass of .*:TrainingStage"):
            register_stage(type("Loose", (), {"name": "loose"}))  # type: ignore[arg-type]
    finally:
        STAGE_TYPES.pop("registry_probe", None)
    assert stage_names() == ("transfer", "distill", "lora", "full", "retention")


STAGE_MODULE = "tests.custom_stage"


def test_a_stage_of_ones_own_from_a_configs_imports(tiny_llama, tmp_path):
    """tests/custom_stage.py registers `scaled_kernel`; a config that imports it configures the stage (its
    defaults join the config), the stage's own check runs, and a tiny run trains it: its first loss is `weight`
    times the task loss that a plain run's first (LoRA, still the identity) step logs."""
    assert "scaled_kernel" not in STAGE_TYPES and STAGE_MODULE not in sys.modules
    common = {"stages.transfer.steps": 0, "validate": False, "save_every": 0}
    path = write_config(tmp_path / "c.yaml", lm_config(tiny_llama, tmp_path / "o", imports=[STAGE_MODULE], **common,
                                                       **{"stages.lora.steps": 0, "stages.scaled_kernel.steps": 2}))
    from hf_kernel_attn.training import Trainer

    try:
        config = load_config(path, ["stages.scaled_kernel.weight=3"])
        assert list(config["stages"]) == ["transfer", "distill", "lora", "full", "retention", "scaled_kernel"]
        assert config["stages"]["scaled_kernel"] == {**COMMON_DEFAULTS, "lr": 5e-3, "weight": 3, "steps": 2}
        assert load_config(path)["stages"]["scaled_kernel"]["weight"] == 2.0  # the stage's default
        with pytest.raises(ConfigError, match="stages.scaled_kernel.weight must be a number > 0"):
            load_config(path, ["stages.scaled_kernel.weight=0"])
        with pytest.raises(ConfigError, match="did you mean 'stages.scaled_kernel.weight'"):
            load_config(path, ["stages.scaled_kernel.wieght=1"])
        Trainer(config).run()
        plain = lm_config(tiny_llama, tmp_path / "plain", **common, **{"stages.lora.steps": 1})
        Trainer(load_config(write_config(tmp_path / "plain.yaml", plain))).run()
    finally:
        STAGE_TYPES.pop("scaled_kernel", None)
        sys.modules.pop(STAGE_MODULE, None)
    log = read_log(tmp_path / "o")
    assert [r["stage"] for r in log] == ["scaled_kernel"] * 2
    assert log[0]["loss"] == pytest.approx(3 * read_log(tmp_path / "plain")[0]["loss"], rel=1e-5)
    resolved = yaml.safe_load((tmp_path / "o" / "config.resolved.yaml").read_text())
    assert resolved["imports"] == [STAGE_MODULE] and resolved["stages"]["scaled_kernel"]["weight"] == 3
    # without the import the stage is unknown
    no_import = lm_config(tiny_llama, tmp_path / "x", **{"stages.scaled_kernel.steps": 2})
    with pytest.raises(ConfigError, match="unknown config key 'stages.scaled_kernel'"):
        load_config(write_config(tmp_path / "x.yaml", no_import))
