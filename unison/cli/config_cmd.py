"""``unison config``: the config a run would use, as YAML; ``unison schema``: its JSON Schema.

``unison config CONFIG`` reads and validates the config as ``unison run`` does before it
starts any rank, and prints it resolved: every key with its value after defaults, old names
and other trainers' keys under unison's names (:func:`~unison.config.canonical.canonical`),
``--set`` applied, URL credentials masked. The text loads again with
:func:`~unison.config.load_config` into an equal config. Nothing of the user's is imported
unless ``--check`` asks for the checks ``unison run`` makes next: every ``!pyobject``
resolved and the model built on the meta device (:func:`~unison.recipe.build.preflight.preflight`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from unison.config import ConfigError, UnisonLoader, dump_config, load_config
from unison.config.canonical import canonical, source_of
from unison.config.origin import KeyPath, Origin
from unison.config.schema_walk import walk_keys
from unison.utils.secrets import redact_url


def show_config(
    path: str | os.PathLike[str],
    overrides: list[str] | None = None,
    *,
    check: bool = False,
    show_origin: bool = False,
) -> str:
    """The resolved config of ``path`` (with ``overrides``, as ``--set`` gives them) as YAML text.

    Args:
        path: the config file.
        overrides: ``KEY.PATH=VALUE`` settings.
        check: also resolve every ``!pyobject`` and run the checks ``unison run`` makes before spawning
            (this imports the modules the config names).
        show_origin: end each line of a key the config gives with ``# <file>:<line>``, or ``# --set ...``.

    Raises:
        ConfigError: naming the file, the line and the key, as ``unison run`` does.
    """
    config = load_config(path, overrides)
    if check:
        from unison.recipe.build.preflight import preflight
        from unison.recipe.planning.run_plan import launch_world_size, plan

        preflight(plan(config, world_size=launch_world_size(config)))  # parallel.nproc_per_node ranks
    text = redact_url(dump_config(canonical(config)))  # URL credentials masked
    if show_origin:
        text = with_origins(text, config.origin)  # each comment masked on its own
    return text


def with_origins(text: str, origin: Origin) -> str:
    """``text`` (a config as :func:`~unison.config.dump_config` writes it) with ``# file:line`` or
    ``# --set key=value`` after each key ``origin`` says was given; sections and keys whose value
    runs over several lines are left as they are."""
    lines = text.split("\n")
    sections = {key.path for key in walk_keys() if key.is_section}
    for index, path in _key_lines(text):
        source = None if path in sections else source_of(path, origin)
        if source is None:
            continue
        where = origin.file_of(source)
        line = origin.line_of(source)
        note = where if line is None else f"{_short(where)}:{line}"  # a --set has no line
        lines[index] += f"  # {redact_url(str(note))}"  # apart from the line: a "@" in it would end a password
    return "\n".join(lines)


def _short(file: str | None) -> str:
    """A file as the comment names it: relative to the working directory when it is inside it."""
    if file is None:
        return "<config>"
    try:
        return str(Path(file).relative_to(Path.cwd()))
    except ValueError:
        return file


def _key_lines(text: str) -> list[tuple[int, KeyPath]]:
    """(line index, key path) of each key of ``text`` whose line can end with a comment: its value is on
    the same line, or is a block below it."""
    found: list[tuple[int, KeyPath]] = []

    def walk(node: yaml.Node, prefix: KeyPath) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value in node.value:
                path = prefix + (str(key_node.value),)
                line = key_node.start_mark.line
                block = isinstance(value, (yaml.MappingNode, yaml.SequenceNode)) and not value.flow_style
                if block or value.end_mark.line == line:
                    found.append((line, path))
                walk(value, path)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, prefix + (str(i),))

    root = yaml.compose(text, Loader=UnisonLoader)  # noqa: S506 - a SafeLoader subclass
    if root is not None:
        walk(root, ())
    return found


def run_config(args: argparse.Namespace) -> int:
    """``unison config``: prints the resolved config; 2 and the error on stderr for a bad config."""
    try:
        text = show_config(args.config, args.set, check=args.check, show_origin=args.show_origin)
    except ConfigError as err:
        if args.debug:
            raise
        print(f"unison config: {redact_url(str(err))}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


def run_schema(args: argparse.Namespace) -> int:
    """``unison schema``: writes the config's JSON Schema to ``--out``, or prints it."""
    from unison.config.json_schema import json_schema_text

    text = json_schema_text()
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        Path(args.out).write_text(text)
    except OSError as err:
        print(f"unison schema: --out {args.out}: cannot write it ({err.strerror or err})", file=sys.stderr)
        return 2
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
