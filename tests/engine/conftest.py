"""Session fixtures: one tiny transformers checkpoint per architecture case (fp32, and saved in bf16), and the
oracle's outputs."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from engine_helpers import MAX_NEW, PROMPT_LENGTHS, SPECS, build_hf_model, hf_greedy, random_prompts, save_checkpoint


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from threads, and on a shared machine OpenMP spinning costs a lot."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Case:
    """A saved checkpoint, its transformers model, prompts and transformers' greedy continuations."""

    def __init__(self, name: str, root) -> None:
        self.name = name
        self.hf = build_hf_model(name)
        self.path = save_checkpoint(self.hf, root / name)
        self.prompts = random_prompts(PROMPT_LENGTHS, seed=len(name))
        self._expected: list[list[int]] | None = None

    @property
    def expected(self) -> list[list[int]]:
        if self._expected is None:
            self._expected = [hf_greedy(self.hf, p, MAX_NEW) for p in self.prompts]
        return self._expected


@pytest.fixture(scope="session")
def cases(tmp_path_factory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("engine_ckpt")
    return {name: Case(name, root) for name in SPECS}


@pytest.fixture(params=list(SPECS))
def case(request, cases) -> Case:
    return cases[request.param]


@pytest.fixture(scope="session")
def bf16_checkpoints(cases, tmp_path_factory):
    """Each case saved in bf16 (as most published checkpoints are), and transformers on it in fp32."""
    root, out = tmp_path_factory.mktemp("bf16_ckpt"), {}
    for name, case in cases.items():
        path = root / name
        copy.deepcopy(case.hf).to(torch.bfloat16).save_pretrained(path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[name] = (path, hf)
    return out


@pytest.fixture(scope="module")
def bf16_paths(bf16_checkpoints):
    """Each case's bf16 checkpoint folder."""
    return {name: path for name, (path, _) in bf16_checkpoints.items()}
