"""`pip install .[gpu]` resolves: our own pins (setup.cfg) admit every pin of the SGLang
release the `gpu` extra names, on the platform its wheels exist for (Linux x86_64,
CPython 3.11-3.13). Offline, from SGLang's vendored Requires-Dist (tests/data): its CUDA
wheels are never downloaded here."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
SGLANG_REQUIRES = ROOT / "tests" / "data" / "sglang-0.5.23-requires.txt"


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def _reqs(text: str) -> list[Requirement]:
    lines = (ln.split("#", 1)[0].strip() for ln in text.splitlines())
    return [Requirement(ln) for ln in lines if ln]


def ours() -> dict[str, Requirement]:
    return {
        canonicalize_name(r.name): r for r in _reqs(_setup_cfg()["options"]["install_requires"])
    }


def sglang_pins(python: str) -> dict[str, SpecifierSet]:
    """SGLang's requirements that apply on Linux x86_64 under CPython `python`."""
    return release_pins(SGLANG_REQUIRES, python)


def release_pins(requires: Path, python: str) -> dict[str, SpecifierSet]:
    """A release's requirements (its `requires.txt`, base install only) that apply on Linux
    x86_64 under CPython `python`, merged per package."""
    env = {
        **default_environment(),
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "python_version": python,
        "python_full_version": f"{python}.0",
        "implementation_name": "cpython",
    }
    out: dict[str, SpecifierSet] = {}
    for r in _reqs(requires.read_text()):
        if r.marker is None or r.marker.evaluate({**env, "extra": ""}):
            name = canonicalize_name(r.name)
            out[name] = out.get(name, SpecifierSet()) & r.specifier
    return out


def _candidates(*specs: SpecifierSet) -> list[Version]:
    """The versions where two specifier sets can meet: their own bounds and just above."""
    vs = []
    for spec in specs:
        for s in spec:
            v = Version(s.version.replace(".*", ".0"))
            r = (*v.release, 0, 0)
            vs += [v, Version(f"{r[0]}.{r[1]}.{r[2] + 1}"), Version(f"{r[0]}.{r[1] + 1}.0")]
            vs.append(Version(f"{r[0] + 1}.0.0"))
    return vs or [Version("1.0")]


def test_the_vendored_metadata_is_the_release_the_gpu_extra_pins():
    extra = _reqs(_setup_cfg()["options.extras_require"]["gpu"])
    (sglang,) = [r for r in extra if canonicalize_name(r.name) == "sglang"]
    assert str(sglang.specifier) == "==0.5.23" and "sglang 0.5.23" in SGLANG_REQUIRES.read_text()


@pytest.mark.parametrize("python", ["3.11", "3.12", "3.13"])
def test_our_pins_admit_sglangs(python):
    mine, theirs = ours(), sglang_pins(python)
    shared = sorted(set(mine) & set(theirs))
    # the ones that matter: SGLang hard-pins torch, transformers, tokenizers and numba
    assert {"torch", "transformers", "tokenizers", "numba", "numpy", "psutil"} <= set(shared)
    conflicts = []
    for name in shared:
        a, b = mine[name].specifier, theirs[name]
        if not any(a.contains(v, prereleases=True) and b.contains(v, prereleases=True)
                   for v in _candidates(a, b)):  # fmt: skip
            conflicts.append(f"{name}: ours {a or 'any'}, sglang {b}")
    assert not conflicts, conflicts
    assert SpecifierSet(_setup_cfg()["options"]["python_requires"]).contains(f"{python}.0")


def test_the_pins_the_readme_states():
    theirs = sglang_pins("3.11")
    for name, pin in {
        "torch": "==2.14.1",
        "transformers": "==5.19.0",
        "tokenizers": "==0.23.2",
        "numba": "==0.65.1",
        "torchaudio": "==2.11.0",
        "flashinfer-python": "==0.7.2",
        "cuda-python": ">=13.0",
    }.items():
        assert str(theirs[name]) == pin, name
    readme = (ROOT / "README.md").read_text()
    for text in ("torch==2.14.1", "transformers==5.19.0", "manylinux_2_34", "glibc"):
        assert text in readme, text
