"""YAML loading for the collector: ``${env:VAR}`` substitution, merging of several files, and key -> line marks.

Every mapping and list is loaded with the YAML marks of its nodes so that a validation error can name the
offending key path *and* the file and line where it was written (``exporters.debug.verbosity (collector.yaml:31)``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_ENV = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$\$")
_PH = "__otel_straggler_env_"
_PH_RE = re.compile(re.escape(_PH) + r"(\d+)__")
# What one config may expand to: YAML aliases repeat a node wherever they stand, so a few lines of anchors can
# stand for billions of values (an "alias bomb"); the expansion stops, with an error, past these.
MAX_CONFIG_VALUES = 100_000
MAX_CONFIG_DEPTH = 64
MAX_CONFIG_BYTES = 4 * 1024 * 1024


class ConfigError(ValueError):
    """A configuration problem; the message names the key path and, when known, the file and line."""


@dataclass
class Marks:
    """Where each key path (tuple of keys / list indices) was last defined."""

    where: dict[tuple[Any, ...], str] = field(default_factory=dict)
    # Values that came from the environment -> the ``${env:NAME}`` they came from: error messages show the
    # reference, never the value (it may be a secret placed in the wrong key).
    env_values: dict[str, str] = field(default_factory=dict)

    def redact(self, text: str) -> str:
        for value in sorted(self.env_values, key=len, reverse=True):
            text = text.replace(value, self.env_values[value])
        return text

    def locate(self, path: tuple[Any, ...]) -> str:
        """The file:line of the deepest known prefix of ``path``."""
        for n in range(len(path), -1, -1):
            hit = self.where.get(tuple(path[:n]))
            if hit:
                return hit
        return ""


def substitute_env(text: str, env: dict[str, str] | None = None, where: str = "") -> str:
    """Replace ``${env:VAR}`` and ``${env:VAR:-default}``; ``$$`` is a literal ``$``. A missing VAR without a
    default is an error (like an empty value it would silently disable things)."""
    env = os.environ if env is None else env

    def repl(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, default = m.group(1), m.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        raise ConfigError(f"environment variable {name} is not set and has no default (${{env:{name}:-...}}) {where}")

    return _ENV.sub(repl, text)


def _scalar(node: yaml.ScalarNode) -> Any:
    return yaml.SafeLoader("").construct_object(node, deep=True)


def _walk(node: yaml.Node, path: tuple[Any, ...], src: str, marks: Marks, env: dict[str, str] | None,
          tokens: list[str], budget: list[int] | None = None) -> Any:
    if budget is None:
        budget = [MAX_CONFIG_VALUES]
    budget[0] -= 1
    if budget[0] < 0:
        raise ConfigError(f"{src}: the configuration expands to more than {MAX_CONFIG_VALUES} values "
                          f"(YAML aliases repeat what they refer to), at line {node.start_mark.line + 1}")
    if len(path) > MAX_CONFIG_DEPTH:
        raise ConfigError(f"{src}: nested deeper than {MAX_CONFIG_DEPTH} levels at line {node.start_mark.line + 1}")
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for k_node, v_node in node.value:
            key = _walk(k_node, path, src, marks, env, tokens, budget)
            if not isinstance(key, str | int | float | bool) and key is not None:
                raise ConfigError(f"unsupported key type at {'.'.join(map(str, path)) or '<root>'} "
                                  f"({src}:{k_node.start_mark.line + 1})")
            key = "" if key is None else str(key)
            if key == "<<":
                raise ConfigError(f"YAML merge keys are not supported ({src}:{k_node.start_mark.line + 1})")
            sub = (*path, key)
            marks.where[sub] = f"{src}:{k_node.start_mark.line + 1}"
            out[key] = _walk(v_node, sub, src, marks, env, tokens, budget)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for i, item in enumerate(node.value):
            sub = (*path, i)
            marks.where[sub] = f"{src}:{item.start_mark.line + 1}"
            items.append(_walk(item, sub, src, marks, env, tokens, budget))
        return items
    assert isinstance(node, yaml.ScalarNode)
    value = node.value
    if _PH in value:
        loc = f"({src}:{node.start_mark.line + 1})"
        def sub(m: re.Match[str]) -> str:
            token = tokens[int(m.group(1))]
            out = substitute_env(token, env, loc)
            if len(out) >= 4:
                marks.env_values[out] = token.split(":-", 1)[0].rstrip("}") + "}"
            return out

        value = _PH_RE.sub(sub, value)
        if node.style is None:  # plain scalar: re-resolve the type after substitution (ports, booleans, numbers)
            if value == "":
                return ""
            try:
                loaded = yaml.safe_load(value)
            except yaml.YAMLError:
                return value
            if isinstance(loaded, bool):
                return loaded if value.strip().lower() in ("true", "false") else value
            return loaded if isinstance(loaded, int | float) else value
        return value
    return _scalar(node)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """The parser's problem and line, without PyYAML's snippet of the offending line (it may hold a secret)."""
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        return f"{e.context + ': ' if e.context else ''}{e.problem or 'syntax error'}{where}"
    return type(e).__name__


def load_text(text: str, src: str = "<string>", env: dict[str, str] | None = None,
              marks: Marks | None = None) -> tuple[dict[str, Any], Marks]:
    marks = marks or Marks()
    # ``${env:...}`` is swapped for an inert placeholder before parsing (so it may stand unquoted anywhere, even in
    # a flow mapping) and substituted inside the parsed scalar: a value can never inject YAML structure.
    tokens: list[str] = []

    def hold(m: re.Match[str]) -> str:
        tokens.append(m.group(0))
        return f"{_PH}{len(tokens) - 1}__"

    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{src}: larger than {MAX_CONFIG_BYTES // (1024 * 1024)} MiB")
    text = _ENV.sub(hold, text)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML in {src}: {_yaml_problem(e)}") from None
    except RecursionError:
        raise ConfigError(f"invalid YAML in {src}: nested too deeply") from None
    if node is None:
        return {}, marks
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"{src}: the top level must be a mapping")
    return _walk(node, (), src, marks, env, tokens), marks


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge mappings; lists and scalars from ``over`` replace (the OTel Collector's rule)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def load_files(paths: list[str | Path], env: dict[str, str] | None = None) -> tuple[dict[str, Any], Marks]:
    marks = Marks()
    merged: dict[str, Any] = {}
    if not paths:
        raise ConfigError("no --config given")
    for p in paths:
        path = Path(p)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e.strerror}") from e
        data, marks = load_text(text, path.name, env, marks)
        merged = merge(merged, data)
    return merged, marks
