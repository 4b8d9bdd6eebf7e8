"""Engine arguments that name code, refused in a config: a config can be wrong, never code.

`engines.<role>.vllm_args` and `server_args` reach vLLM's EngineArgs and SGLang's
ServerArgs as given. Some of their keys make the engine import a class by dotted name or
run the model directory's Python files, so a config handed to you could run code through
them. The keys below (read from vLLM 0.32's engine/arg_utils.py: each is imported by
`resolve_obj_by_qualname`/`importlib` or executed; SGLang 0.5.23 by name, as it is not
installed here to read), and any key that by its name holds a class, a module or a plugin
(`*_cls`, `*_class`, `*_module`, `*_module_path`, `*_plugin`, `*_qualname`), are refused
at validation in one line naming the key. The one config key that names code on purpose
is `rl.grpo.loss_fn` (docs/guide/security.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pivot_hpc.errors import fail

VLLM_CODE_ARGS: dict[str, str] = {
    "trust_remote_code": "runs the model directory's own Python files",
    "worker_cls": "imports a worker class by dotted name",
    "worker_extension_cls": "imports a worker extension class by dotted name",
    "scheduler_cls": "imports a scheduler class by dotted name",
    "distributed_executor_backend": "imports an executor class by dotted name",
    "logits_processors": "imports logits processors by dotted name",
    "model_class_overrides": "registers model classes by dotted name",
    "compilation_config": "can name a compile backend and passes by dotted name",
    "kv_transfer_config": "can name a KV connector module",
    "kv_events_config": "can name a KV events publisher",
    "ec_transfer_config": "can name an encoder-cache connector module",
    "ec_manager_config": "can name an encoder-cache manager class",
    "speculative_config": "can name a proposer module and a draft model's code",
    "reasoning_parser_plugin": "imports a Python file",
    "io_processor_plugin": "loads a plugin",
    "logging_config": "builds loggers whose handlers can be any class",
    "log_config_file": "builds loggers whose handlers can be any class",
    "hf_overrides": "rewrites the model's config, which can name its code",
}
SGLANG_CODE_ARGS: dict[str, str] = {
    "trust_remote_code": "runs the model directory's own Python files",
    "custom_weight_loader": "imports weight loaders by dotted name",
    "enable_custom_logit_processor": "runs logit processors sent as pickles",
    "forward_hooks": "imports hook factories by dotted name",
    "json_model_override_args": "rewrites the model's config, which can name its code",
}
CODE_SUFFIXES = ("_cls", "_class", "_module", "_module_path", "_plugin", "_qualname")


def code_problem(key: str, known: Mapping[str, str]) -> str | None:
    """Why engine argument `key` names code (None: it does not)."""
    if key in known:
        return known[key]
    if key.endswith(CODE_SUFFIXES) or key == "plugins":
        return "names a class, module or plugin to load"
    return None


def refuse_code_args(path: str, engine_config: Any) -> None:
    """ConfigError naming the first code-naming key of `engine_config`'s vllm_args or
    server_args (an engines.<role> section at `path`)."""
    for section, known, engine in (
        ("vllm_args", VLLM_CODE_ARGS, "vLLM"),
        ("server_args", SGLANG_CODE_ARGS, "SGLang"),
    ):
        args = getattr(engine_config, section, None) or {}
        for key in sorted(args):
            why = code_problem(str(key), known)
            if why is not None and args[key] not in (False, None, ""):  # off is harmless
                fail(
                    f"{path}.{section}.{key}",
                    args[key],
                    f"{engine} {why}, and a config may not name code (docs/guide/security.md); "
                    "remove the key (a custom model or class belongs in the installed code "
                    "you run, not in a config)",
                )
