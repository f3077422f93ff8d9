import pytest

from qmoe import demo


def test_demo_runs_and_checks_pass():
    assert demo.main(["--tokens", "64", "--hidden", "64", "--ffn", "64", "--iters", "1",
                      "--no-compile"]) == 0


@pytest.mark.compile
def test_demo_compiled_blockwise():
    """The README's main job compiles (fullgraph, forward and backward): one recipe here,
    the default one, to keep CI short."""
    assert demo.main(["--tokens", "64", "--hidden", "64", "--ffn", "64", "--iters", "1",
                      "--recipes", "blockwise"]) == 0


def test_demo_rejects_unknown_recipes(capsys):
    with pytest.raises(SystemExit) as info:
        demo.main(["--recipes", "blockwise,fp4"])
    assert info.value.code == 2
    assert "--recipes: unknown ['fp4']" in capsys.readouterr().err
