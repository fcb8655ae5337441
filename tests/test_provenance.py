"""What a run's report says produced it (``jdqn.provenance``), and the warning for a JAX
version the project is not tested on."""

from __future__ import annotations

import platform
import warnings

import jax
import numpy as np
import pytest
from helpers import tiny_config

import jdqn
from jdqn import provenance
from jdqn.config import ConfigError


def test_versions_name_python_jdqn_and_the_packages_in_this_process():
    v = provenance.versions()
    assert set(v) == {"python", "jdqn", *provenance.PACKAGES}
    assert v["python"] == platform.python_version() and v["jdqn"] == jdqn.__version__
    assert v["jax"] == jax.__version__ and v["numpy"] == np.__version__
    assert v["jaxlib"] and v["flax"] and v["orbax-checkpoint"]  # installed with jdqn


@pytest.mark.parametrize("version", ["0.10.0", "0.10.2", "0.11.2", "0.11.3.dev20261201"])
def test_the_tested_jax_versions_get_no_warning(version):
    assert provenance.untested_jax(version) is None


@pytest.mark.parametrize("version", ["0.12.0", "0.9.2", "1.0.0", "0.12", "weird"])
def test_other_jax_versions_are_named_in_the_warning(version):
    msg = provenance.untested_jax(version)
    assert msg is not None and f"jax {version} is not a version" in msg
    assert "0.10 and 0.11" in msg and 'model.impl = "xla"' in msg


def test_the_running_jax_is_a_tested_one():
    # The suite runs on a tested JAX (CI's 0.10, the GPU machines' 0.11), so a job warns nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        provenance.warn_if_untested_jax()


def test_a_job_on_an_untested_jax_warns_before_anything_else(tmp_path, monkeypatch):
    # run_job warns first; here it then stops at once (a multi-host config in a process that
    # joined no job), so nothing compiles
    monkeypatch.setattr(jax, "__version__", "0.12.0")
    from jdqn.train.job import run_job

    cfg = tiny_config("parallel.n_devices=0", "parallel.distributed=true")
    with pytest.warns(UserWarning, match=r"jax 0\.12\.0 is not a version jdqn is tested on"):
        with pytest.raises(ConfigError, match="has not joined a multi-process job"):
            run_job(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_tested_versions_are_the_ones_pyproject_admits():
    # Widening (or narrowing) the pin without TESTED_JAX, or the other way round, fails here
    import re
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml")
                            .read_text())["project"]
    for name in ("jax", "jaxlib"):
        (spec,) = [d for d in project["dependencies"] if re.match(rf"{name}\s*[<>=]", d)]
        lo = re.search(r">=\s*(\d+)\.(\d+)", spec)
        hi = re.search(r"<\s*(\d+)\.(\d+)", spec)
        assert lo and hi, spec
        lo, hi = (int(lo[1]), int(lo[2])), (int(hi[1]), int(hi[2]))
        assert lo[0] == hi[0] == 0, spec  # minor versions of 0.x
        admitted = tuple((0, m) for m in range(lo[1], hi[1]))
        assert admitted == provenance.TESTED_JAX, spec
