from dataclasses import dataclass

import pytest

from lablib.jobs import config as cfg


@dataclass(frozen=True)
class Demo:
    steps: int = 3
    lr: float = 0.1
    name: str = "x"
    flag: bool = False
    sizes: tuple[int, ...] = (1, 2)

    def validate(self):
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be at least 1")


def test_round_trip_through_argv():
    c = cfg.from_options(Demo, {"steps": 5, "lr": 1, "flag": True, "sizes": (4, 8)})
    assert c == Demo(steps=5, lr=1.0, flag=True, sizes=(4, 8))
    assert cfg.from_argv(Demo, cfg.to_argv(c)) == c


def test_unknown_option_lists_the_accepted_ones():
    with pytest.raises(cfg.ConfigError, match=r"unknown option\(s\) stpes.*accepted options: steps: int = 3"):
        cfg.from_options(Demo, {"stpes": 4})


@pytest.mark.parametrize("options", [{"steps": "many"}, {"steps": 2.5}, {"lr": "fast"}, {"flag": "maybe"}, {"steps": True}])
def test_wrong_types_are_errors(options):
    with pytest.raises(cfg.ConfigError, match="should be of type"):
        cfg.from_options(Demo, options)


def test_validate_runs():
    with pytest.raises(ValueError, match="steps=0 must be at least 1"):
        cfg.from_options(Demo, {"steps": 0})


def test_argv_forms():
    assert cfg.from_argv(Demo, ["--steps=7", "--name", "y"]) == Demo(steps=7, name="y")
    with pytest.raises(cfg.ConfigError, match="has no value"):
        cfg.from_argv(Demo, ["--steps"])
    with pytest.raises(cfg.ConfigError, match="expected --name value pairs"):
        cfg.from_argv(Demo, ["7"])


def test_setup_refuses_to_install_into_a_linked_venv(tmp_path):
    """launchers/_setup.sh installs lablib editable into .venv; into a .venv linked from another checkout that would
    re-point the other checkout's environment at this one. With a stale stamp (the files differ), it must refuse
    before installing anything and say how to get an environment of its own."""
    import subprocess
    from pathlib import Path
    REPO = Path(__file__).resolve().parent.parent
    checkout, elsewhere = tmp_path / "checkout", tmp_path / "other-venv"
    (checkout / "launchers").mkdir(parents=True)
    elsewhere.mkdir()
    for name in ("requirements.txt", "pyproject.toml", "launchers/_setup.sh"):
        (checkout / name).write_bytes((REPO / name).read_bytes())
    (checkout / ".venv").symlink_to(elsewhere)
    done = subprocess.run(["bash", "-c", "source launchers/_setup.sh"], cwd=checkout, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1, done.stderr
    assert "is a link to" in done.stderr and f"rm {checkout}/.venv" in done.stderr, done.stderr
    assert list(elsewhere.iterdir()) == [], "nothing may be installed into the other checkout's environment"
