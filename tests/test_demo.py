import pytest

from qmoe import demo

# The layer the demo trains compiles with fullgraph=True in tests/nn/test_moe.py
# (test_compile_dynamic_tokens_no_recompile); the demo's --compile adds no other code.

SMALL = ["--steps", "100", "--tokens", "128", "--hidden", "64", "--ffn", "64", "--lr", "1e-2"]


def test_demo_trains_every_recipe_and_passes(tmp_path, capsys):
    """The README's main job, shortened: every recipe trains, FP8 final losses within the
    tolerance of bf16's, and the curves are drawn as a PNG."""
    png = tmp_path / "loss.png"
    assert demo.main([*SMALL, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and out.count(" ok (tolerance") == len(demo.RECIPES)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_fails_when_fp8_loss_is_off(monkeypatch, capsys):
    """The verdict can fail: a tolerance of 0 flags any gap."""
    assert demo.main([*SMALL, "--recipes", "mx", "--tolerance", "0", "--plot", ""]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_demo_rejects_unknown_recipes(capsys):
    with pytest.raises(SystemExit) as info:
        demo.main(["--recipes", "blockwise,fp4"])
    assert info.value.code == 2
    assert "--recipes: unknown ['fp4']" in capsys.readouterr().err
