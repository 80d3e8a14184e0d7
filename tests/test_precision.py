"""--precision auto, the default: bf16 only where the device computes it natively (on a CPU: the avx512_bf16,
amx_bf16 or ARM bf16 flag), else fp32; a run says what it uses and why, and warns where bf16 is emulated."""
import io
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from nanoforge.core.config import build_config
from nanoforge.core.device import cpu_info, native_bf16, precision_note, resolve_precision
from nanoforge.train.plan import make_plan

from conftest import free_port
from test_loop import corpus_files, pretrain_dir  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
AVX2_ONLY = ("AMD EPYC 7B13", {"fpu", "sse2", "avx", "avx2", "fma", "f16c"})


@pytest.mark.parametrize("flags, native", [
    ({"avx2", "avx512f", "avx512_bf16"}, True),  # Zen 4/5, Cooper Lake
    ({"avx2", "avx512f", "amx_tile", "amx_bf16"}, True),  # Sapphire Rapids' AMX
    ({"fp", "asimd", "sve", "bf16"}, True),  # ARM FEAT_BF16 (Graviton 3), from Linux's Features line
    ({"avx2", "avx512f", "avx512bw"}, False),  # AVX-512 without BF16 (Skylake-SP)
    (AVX2_ONLY[1], False),
    (set(), False),  # no flags to read (macOS, Windows)
])
def test_auto_is_bf16_only_where_the_cpu_computes_it_natively(flags, native):
    cpu = ("some cpu", flags)
    assert native_bf16(CPU, cpu)[0] is native
    assert resolve_precision("auto", CPU, cpu) == ("bf16" if native else "fp32")
    for explicit in ("fp32", "bf16", "fp16"):  # an explicit precision is kept, whatever the CPU
        assert resolve_precision(explicit, CPU, cpu) == explicit


def test_the_notes_say_what_and_why():
    note = precision_note("fp32", CPU, AVX2_ONLY)
    assert note.startswith("precision: fp32 (auto: this CPU (AMD EPYC 7B13) has no native bf16 (avx512_bf16/amx_bf16)")
    assert "emulated" in note
    warning = precision_note("bf16", CPU, AVX2_ONLY)  # asked for explicitly: it runs, with a warning
    assert warning.startswith("warning: bf16 was asked for, but this CPU (AMD EPYC 7B13) has no native bf16")
    assert "--precision auto picks fp32" in warning
    amx = ("Intel Xeon Platinum 8480+", {"avx512_bf16", "amx_bf16"})
    assert precision_note("bf16", CPU, amx) == ("precision: bf16 (auto: this CPU (Intel Xeon Platinum 8480+) has "
                                                "native bf16: avx512_bf16, amx_bf16)")
    assert precision_note("fp32", CPU, amx).startswith("precision: fp32 (auto would pick bf16: ")


def test_cpu_info_reads_the_first_processor_and_survives_no_file(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                   "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
    assert cpu_info(str(x86)) == ("AMD EPYC 9B14", {"fpu", "avx2", "avx512_bf16"})
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16\nCPU part\t: 0xd40\n")
    assert cpu_info(str(arm))[1] == {"fp", "asimd", "sve", "bf16"}
    model, flags = cpu_info(str(tmp_path / "absent"))
    assert model and flags == set()


def test_the_recipes_leave_precision_to_auto():
    for path in sorted((ROOT / "configs").glob("*.toml")):
        assert tomllib.loads(path.read_text()).get("train", {}).get("precision", "auto") == "auto", path.name


def test_plan_reads_auto_as_the_planned_devices_pick():
    mcfg, tcfg = build_config("mini")
    assert tcfg.precision == "auto"
    make_plan(mcfg, tcfg, device="rtx3090")
    assert tcfg.precision == "bf16"
    mcfg, tcfg = build_config("mini")
    make_plan(mcfg, tcfg, device="cpu", tokens_per_s=1000.0)
    assert tcfg.precision == resolve_precision("auto", CPU)


def test_a_run_prints_its_pick_and_saves_it(pretrain_dir, tmp_path):  # noqa: F811
    """The real CLI with the default precision on this machine: one line names the choice and why, and
    config.toml keeps the precision the run used (a resume there keeps it)."""
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "nanoforge", "pretrain", "--preset", "tiny", "--data", str(pretrain_dir),
                        "--out", str(run), "--device", "cpu", "--max-steps", "2", "--warmup-steps", "1",
                        "--eval-every", "0", "--tensorboard", "false"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    picked = resolve_precision("auto", CPU)
    native, hardware = native_bf16(CPU)
    assert native is (picked == "bf16")
    assert f"precision: {picked} (auto: {hardware})" in r.stderr.splitlines()
    assert f"this CPU ({cpu_info()[0]}) has " in hardware
    assert tomllib.loads((run / "config.toml").read_text())["train"]["precision"] == picked


AMX = ("Intel Xeon Platinum 8480+", {"avx2", "avx512_bf16", "amx_bf16"})


class Terminal(io.StringIO):
    """Standard input as a person's terminal: `chat` talks (and announces what it loaded), not a script's pipe."""

    def isatty(self) -> bool:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("cpu", [AMX, AVX2_ONLY], ids=["native-bf16", "no-native-bf16"])
def test_every_command_picks_the_same_precision(cpu, pretrain_dir, tmp_path, monkeypatch, capsys):  # noqa: F811
    """--precision auto through the real commands, in this process, on a CPU with and without native bf16 (its
    flags faked): train, eval, generate, chat, serve, bench and plan each say the one pick of device.py."""
    import nanoforge.recipes.bench
    import nanoforge.core.device
    import nanoforge.serve.app
    from nanoforge.cli import main

    monkeypatch.setattr(nanoforge.core.device, "cpu_info", lambda: cpu)
    monkeypatch.setattr(nanoforge.serve.app.uvicorn.Server, "run", lambda *a, **k: None)  # serve: load, announce, return
    monkeypatch.setattr(nanoforge.recipes.bench, "_run_child", nanoforge.recipes.bench._child)  # bench: measure in this process
    run, cpu_flag = tmp_path / "run", ["--device", "cpu"]

    def said(*argv: str, stdin: str = "") -> list[str]:
        monkeypatch.setattr(sys, "stdin", Terminal(stdin))
        assert main(list(argv)) == 0
        out = capsys.readouterr()
        return re.findall(r"^precision: (\w+) \(", out.err + out.out, re.M) + re.findall(
            r"activations .* per sequence of \d+ \((\w+)\)", out.out)

    picks = {
        "train": said("pretrain", "--preset", "tiny", "--data", str(pretrain_dir), "--out", str(run), *cpu_flag,
                      "--max-steps", "1", "--eval-every", "0", "--tensorboard", "false"),
        "eval": said("eval", str(run), "--max-tokens", "32", *cpu_flag),
        "generate": said("generate", str(run), "--prompt", "a", "--max-new-tokens", "2", *cpu_flag),
        "chat": said("chat", str(run), "--max-new-tokens", "2", *cpu_flag, stdin="hi\n"),
        "serve": said("serve", str(run), "--port", str(free_port()), *cpu_flag),
        "bench": said("bench", "--preset", "tiny", "--steps", "1", "--warmup", "0", "--quiet", *cpu_flag),
        "plan": said("plan", "--preset", "tiny", "--device", "cpu", "--tokens-per-s", "1000"),
    }
    want = resolve_precision("auto", CPU, cpu)
    assert want == ("bf16" if cpu is AMX else "fp32")
    assert picks == {command: [want] for command in picks}
    assert tomllib.loads((run / "config.toml").read_text())["train"]["precision"] == want  # never "auto"
