"""Reading a YAML file whose top level must be a mapping (configs, sharding plans, topology files,
a run's recorded config), with errors that name the file — and the line, for a syntax error or a
duplicate key — in the caller's error type.

Every YAML dlrmctl reads goes through :func:`load_yaml_text` (``--set`` values too): it is
``yaml.safe_load`` except that a mapping giving one key twice is an error
(:class:`DuplicateKeyError`), not "the last value wins".
"""

from __future__ import annotations

import os
import reprlib
import stat
from typing import Any

import yaml


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping gives one key twice (``problem_mark``: the second occurrence; ``key``;
    ``first_line``: the 1-based line of the first)."""

    key: Any = None
    first_line: int = 0


#: the largest YAML file read (configs, plans and topology files are kilobytes to a few megabytes)
MAX_YAML_BYTES = 32 << 20
#: the most nodes a document may expand to through its aliases (``*a`` repeats the whole ``&a``
#: node): a "billion laughs" document of a few hundred bytes is refused before it is built
MAX_YAML_NODES = 2_000_000


class YAMLExpansionError(yaml.YAMLError):
    """A document whose aliases expand it beyond :data:`MAX_YAML_NODES` nodes (``nodes``: a lower bound)."""

    def __init__(self, nodes: int) -> None:
        super().__init__(f"its aliases (*name) expand it to more than {MAX_YAML_NODES:,} nodes")
        self.nodes = nodes


def _expanded_nodes(root: yaml.Node) -> int:
    """Nodes of ``root`` with every alias expanded (each shared node counted each time it is
    used), computed once per distinct node; stops past :data:`MAX_YAML_NODES`."""
    memo: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in memo:
            continue
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for kv in node.value for n in kv]
        if not done:
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in memo)
            continue
        memo[id(node)] = min(1 + sum(memo.get(id(c), 1) for c in children), MAX_YAML_NODES + 1)
    return memo[id(root)]


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (merge keys ``<<`` aside)
    and a document whose aliases expand it beyond :data:`MAX_YAML_NODES` nodes."""

    def get_single_node(self) -> yaml.Node | None:  # noqa: D102
        node = super().get_single_node()
        if node is not None:
            n = _expanded_nodes(node)
            if n > MAX_YAML_NODES:
                raise YAMLExpansionError(n)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:  # noqa: D102
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark)
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
                if first is not key_node.start_mark:
                    err = DuplicateKeyError(None, None, f"duplicate key {key!r}", key_node.start_mark)
                    err.key, err.first_line = key, first.line + 1
                    raise err
        return super().construct_mapping(node, deep=deep)


def load_yaml_text(text: str) -> Any:
    """``yaml.safe_load(text)``, refusing duplicate keys.

    Raises:
        yaml.YAMLError: invalid YAML; :class:`DuplicateKeyError` for a key given twice in a mapping
            (its ``problem_mark`` is the second occurrence).
    """
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)


def _top_level_lines(text: str) -> dict[str, int]:
    """1-based line of each key of the top-level mapping of ``text`` (empty if it is not one)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {str(k.value): k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}


def read_yaml(path: str | os.PathLike, error: type[Exception], what: str, lines: dict | None = None) -> Any:
    """:func:`load_yaml_text` of the file ``path`` (``None`` for an empty file).

    Args:
        error: the exception type to raise (ConfigError, PlanError, ...).
        what: what the file holds, for messages ("config", "plan", "topology file").
        lines: when given, filled with ``{top-level key: 1-based line}`` so that a caller's
            later error about a key can name its line.

    Raises:
        error: unreadable file (``<path>: cannot read <what>: <reason>``), not a regular file (a
            device such as ``/dev/zero``, a FIFO) or larger than :data:`MAX_YAML_BYTES`, aliases
            expanding beyond :data:`MAX_YAML_NODES` nodes, a file that is not UTF-8 text (``<path>: not UTF-8 text ...``), invalid YAML
            (``<path>:<line>: invalid YAML in <what>: <problem>``) or a key given twice in one
            mapping (``<path>:<line>: duplicate key 'k' in <what> (first given on line N ...)``).
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):  # /dev/zero, a FIFO, a terminal: never read whole
                raise error(f"{path}: not a regular file; a {what} is a YAML text file: is this the right file?")
            data = f.read(MAX_YAML_BYTES + 1)
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {e.strerror or e}") from e
    if len(data) > MAX_YAML_BYTES:
        raise error(f"{path}: larger than {MAX_YAML_BYTES >> 20} MiB, which no {what} is; is this the right file?")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise error(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); a {what} "
                    f"is a YAML text file: is this the right file?") from None
    try:
        value = load_yaml_text(text)
    except RecursionError:
        raise error(f"{path}: nested too deeply for a {what} (a YAML document of that many levels of brackets "
                    "is not a config); is this the right file?") from None
    except DuplicateKeyError as e:
        raise error(f"{path}:{e.problem_mark.line + 1}: duplicate key {e.key!r} in {what} (first given on line "
                    f"{e.first_line}; the second would silently replace it): keep one") from None
    except YAMLExpansionError as e:
        raise error(f"{path}: {e} (a {what} of that size through its anchors is not a {what}); is this the "
                    "right file?") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        if mark is None and isinstance(e, yaml.reader.ReaderError):  # control characters: binary data
            line = text[: e.position].count("\n") + 1
            c = e.character if isinstance(e.character, int) else ord(e.character)
            raise error(f"{path}:{line}: not YAML text (control character 0x{c:02x} at offset {e.position}); a "
                        f"{what} is a YAML text file: is this the right file?") from None
        where = f"{path}:{mark.line + 1}" if mark else path
        raise error(f"{where}: invalid YAML in {what}: {getattr(e, 'problem', None) or e}") from e
    if lines is not None:
        lines.update(_top_level_lines(text))
    return value


def read_yaml_mapping(path: str | os.PathLike, error: type[Exception], what: str, expected: str = "",
                      lines: dict | None = None) -> dict:
    """:func:`read_yaml`, and the top level must be a mapping.

    Args:
        what: the file's kind, short ("topology file"): every message names it.
        expected: what the mapping should hold ("keys a, b, ..."), added only to the message of a
            file that was read but holds no mapping (not to a missing or unreadable file's).
        lines: as :func:`read_yaml` (top-level key -> line).

    Raises:
        error: as :func:`read_yaml` (``<path>: cannot read <what>: <OS error>``, one line), or the
            top level is not a mapping (an empty file included).
    """
    d = read_yaml(path, error, what, lines)
    if not isinstance(d, dict):
        raise error(f"{os.fspath(path)}: expected a mapping at the top level of the {what}"
                    f"{f' ({expected})' if expected else ''}, got {'an empty file' if d is None else type(d).__name__}")
    return d


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 3, 6, 6, 80, 80
_SHORT.maxtuple = _SHORT.maxset = _SHORT.maxfrozenset = _SHORT.maxdeque = _SHORT.maxarray = 6


def short_repr(value: Any) -> str:
    """``repr(value)`` bounded for an error message: 3 levels, 6 items a level, 80 characters a
    string (a document expanded through aliases is never printed whole)."""
    return _SHORT.repr(value)
