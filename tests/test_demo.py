from qmoe import demo


def test_demo_runs_and_checks_pass():
    assert demo.main(["--tokens", "64", "--hidden", "64", "--ffn", "64", "--iters", "1",
                      "--no-compile"]) == 0
