"""model.dtype=auto: bfloat16 where bf16 matmuls run natively, float32 elsewhere; each role's own
setting wins; the start-up line says what auto found."""
import pytest

from cluster.config.ppo import DEFAULT_CONFIG, load_config
from core.infra.dtypes import cpu_bf16_flags, resolve_precision

pytestmark = pytest.mark.unit

ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "flags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
OLD_CPU = "flags\t\t: fpu sse2 avx2 fma\n"


def test_cpu_flags_read_from_cpuinfo():
    assert cpu_bf16_flags(ZEN4) == ["AVX512-BF16"]
    assert cpu_bf16_flags(SAPPHIRE_RAPIDS) == ["AMX-BF16", "AVX512-BF16"]
    assert cpu_bf16_flags(OLD_CPU) == [] and cpu_bf16_flags("") == []


@pytest.mark.parametrize("setting, on_gpu, cpuinfo, expected", [
    ("auto", False, ZEN4, ("bfloat16", "CPU has AVX512-BF16")),
    ("auto", False, SAPPHIRE_RAPIDS, ("bfloat16", "CPU has AMX-BF16 and AVX512-BF16")),
    ("auto", False, OLD_CPU, ("float32", "CPU has no native bf16 (neither AMX-BF16 nor AVX512-BF16)")),
    ("auto", True, OLD_CPU, ("bfloat16", "GPU")),
    ("float32", True, SAPPHIRE_RAPIDS, ("float32", "set")),
    ("bfloat16", False, OLD_CPU, ("bfloat16", "set")),
])
def test_auto_resolves_by_device(setting, on_gpu, cpuinfo, expected):
    assert resolve_precision(setting, on_gpu=on_gpu, cpuinfo=cpuinfo) == expected


def test_each_role_follows_model_dtype_unless_it_sets_its_own():
    cfg = load_config(DEFAULT_CONFIG, ["model.dtype=bfloat16"])
    assert {role: d for role, (d, _) in cfg.precision().items()} == dict.fromkeys(
        ("generator", "reference", "reward", "learner"), "bfloat16")
    assert cfg.learner_config().dtype == "bfloat16"
    cfg = load_config(DEFAULT_CONFIG, ["model.dtype=float32", "generator.engine.dtype=bfloat16"])
    assert {role: d for role, (d, _) in cfg.precision().items()} == {
        "generator": "bfloat16", "reference": "float32", "reward": "float32", "learner": "float32"}
    cfg = load_config(DEFAULT_CONFIG, ["model.dtype=auto", "learner.dtype=float32", "generator.num_gpus=1"])
    prec = cfg.precision()
    assert prec["learner"] == ("float32", "set") and prec["generator"] == ("bfloat16", "GPU")
    assert cfg.learner_config().dtype == "float32"


def test_start_up_line_names_each_role_and_why():
    from cluster.runtime.pools.launch import describe_precision
    line = describe_precision(load_config(DEFAULT_CONFIG, ["model.dtype=float32"]))
    assert line == "generator=float32 reference=float32 learner=float32"  # a function reward has no weights
    line = describe_precision(load_config(DEFAULT_CONFIG, ["model.dtype=auto", "generator.num_gpus=1",
                                                           "learner.dtype=float32"]))
    assert line.startswith("generator=bfloat16 reference=") and "(model.dtype=auto: " in line and "GPU" in line
