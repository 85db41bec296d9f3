"""The test command's `--dist loadgroup` keeps each xdist_group on one worker. The engine and serving tests rely on
it so that their compiled programs are built once, not once a worker; with pytest 9 and pytest-xdist 3.8 the
groups were silently ignored (the reason for the `pytest<9` pin in pyproject.toml)."""

import os
import subprocess
import sys
import textwrap


def test_a_group_and_a_grouped_fixture_param_stay_on_one_worker(tmp_path):
    (tmp_path / "test_g.py").write_text(textwrap.dedent("""
        import os, pytest

        def _log(name):
            with open(os.path.join(os.path.dirname(__file__), name + "." + os.environ["PYTEST_XDIST_WORKER"]), "a"):
                pass

        @pytest.fixture(params=["plain", pytest.param("grouped", marks=pytest.mark.xdist_group("p"))])
        def srv(request):
            return request.param

        @pytest.mark.xdist_group("m")
        @pytest.mark.parametrize("i", range(6))
        def test_marked(i):
            _log(f"m{i}")

        @pytest.mark.parametrize("i", range(6))
        def test_param(srv, i):
            _log(f"{srv}{i}")
        """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
           str(tmp_path / "test_g.py")]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ran = [f.name.split(".") for f in tmp_path.iterdir() if "." in f.name and not f.name.endswith(".py")]
    workers = lambda prefix: {w for name, w in ran if name.rstrip("0123456789") == prefix}  # noqa: E731
    assert len(ran) == 18
    assert len(workers("m")) == 1 and len(workers("grouped")) == 1, sorted(ran)
