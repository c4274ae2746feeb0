"""Reading a config's YAML with limits a careless or hostile file cannot get past.

- The file: a regular file (not a FIFO or device), at most ``MAX_BYTES``, UTF-8 (else the line of the
  first bad byte is named).
- Aliases: the document's size with every alias expanded (what a deep copy or a dump of it would
  build) is at most ``MAX_NODES`` nodes: a 400-byte "billion laughs" is refused before it is built.
- Duplicate keys in a mapping (two ``trainer:`` sections) are refused naming both lines; YAML's own
  loader keeps the last silently.
- Tags: ``yaml.SafeLoader``'s only (no Python objects).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Dict, Union

import yaml

MAX_BYTES = 1 << 20
MAX_NODES = 100_000


def read_text(path: Union[str, Path], what: str, max_bytes: int = MAX_BYTES) -> str:
    """The UTF-8 text of the regular file ``path`` (``what`` names it in errors)."""
    path = Path(path)
    st = os.stat(path)  # a missing file: the OSError names it
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{what} {path} is not a regular file (a FIFO, device or folder): give a file")
    if st.st_size > max_bytes:
        raise ValueError(f"{what} {path} is {st.st_size:,} bytes, more than a config's limit of {max_bytes:,}")
    with open(path, "rb") as f:
        raw = f.read(max_bytes + 1)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: {what} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                         f"{e.start}); save it as UTF-8") from None


def load_file(path: Union[str, Path], what: str = "the config") -> Any:
    return loads(read_text(path, what), str(path))


def loads(text: str, where: str) -> Any:
    """``yaml.safe_load(text)`` under the limits above; errors name ``where`` (and the line)."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            size = _expanded_size(node, {}, where)
        except yaml.YAMLError as e:
            raise ValueError(f"{where}: not valid YAML ({' '.join(str(e).split())})") from None
        except RecursionError:
            raise ValueError(f"{where}: the YAML nests too deeply") from None
        if size > MAX_NODES:
            raise ValueError(f"{where}: the YAML expands to more than {MAX_NODES:,} values through its aliases "
                             "(&anchor / *alias): refused")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, sizes: Dict[int, int], where: str) -> int:
    """Nodes in ``node`` with every alias expanded (each shared node counted as often as it is
    reached; computed once per node), duplicate mapping keys refused on the way."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    sizes[id(node)] = MAX_NODES + 1  # a node reached again inside itself (a recursive alias): too big
    total = 1
    if isinstance(node, yaml.MappingNode):
        seen: Dict[Any, int] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                line = key.start_mark.line + 1
                if key.value in seen:
                    raise ValueError(f"{where}:{line}: duplicate key {key.value!r} (first at line {seen[key.value]}); "
                                     "YAML would keep only the last: merge them into one")
                seen[key.value] = line
            total += _expanded_size(key, sizes, where) + _expanded_size(value, sizes, where)
            total = min(total, MAX_NODES + 1)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            total = min(total + _expanded_size(item, sizes, where), MAX_NODES + 1)
    sizes[id(node)] = total
    return total
