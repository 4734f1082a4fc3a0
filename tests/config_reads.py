"""Which config keys pyrl's code reads, by full dotted path, in the driver and in every worker process.

record_reads(config, record_file) gives a copy of a PPOConfig whose dataclass nodes are recording subclasses of
pyrl's own: a field read from a frame of pyrl's code appends the field's full path (actor_rollout_ref.actor.
optim.lr, never just `lr`) and the reading file to record_file, once per node and file. Reads made inside other
code do not count, so bulk readers (dataclasses.asdict for the trackers' config, OmegaConf.structured for
config.yaml, pickling, copying) count as nothing. A node pickles as its path and fields, so the copies Ray hands
the workers record too (this module is pickled by value: the workers cannot import tests/); dataclasses.replace
keeps the path of the node it copies; RecordingOmegaConf, put in pyrl.ppo's place, makes OmegaConf.structured of
a section (data.*, which the datasets read through a DictConfig as verl's do) a view that records the keys read
from it.
"""

import dataclasses
import os
import re
import sys

from omegaconf import OmegaConf

import pyrl
from pyrl.config import PPOConfig, field_types

PYRL_DIR = os.path.dirname(os.path.abspath(pyrl.__file__)) + os.sep
TAGS = ("_reads_path", "_reads_file", "_reads_seen")


def record_reads(config, record_file: str):
    """A copy of `config` (a PPOConfig of plain dataclasses) that records which of its leaves pyrl reads."""
    _keep_paths_through_replace()
    return _recording_copy(config, "", record_file)


def read_keys(record_file: str) -> dict[str, set[str]]:
    """key -> the files of pyrl (relative to pyrl/) that read it."""
    readers: dict[str, set[str]] = {}
    with open(record_file) as f:
        for line in f:
            key, reader = line.split()
            readers.setdefault(key, set()).add(reader)
    return readers


def leaves(cls=PPOConfig, prefix=""):
    """Every leaf key of the schema `cls`, by its full dotted path."""
    for name, kind in field_types(cls).items():
        if dataclasses.is_dataclass(kind):
            yield from leaves(kind, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def interpolation_sources() -> dict[str, str]:
    """Key -> the key its default interpolates (critic.ppo_epochs -> actor_rollout_ref.actor.ppo_epochs): a read of
    the first is, by default, a read of the second."""
    sources = {}

    def walk(node, prefix):
        for f in dataclasses.fields(node):
            value, key = getattr(node, f.name), f"{prefix}{f.name}"
            if dataclasses.is_dataclass(value):
                walk(value, f"{key}.")
            elif isinstance(value, str) and (found := re.fullmatch(r"\$\{(?:oc\.select:)?([\w.]+)(,.*)?\}", value)):
                source = found.group(1)
                sources[key] = f"{prefix}{source[1:]}" if source.startswith(".") else source

    walk(PPOConfig(), "")
    return sources


def with_interpolation_sources(keys: set[str]) -> set[str]:
    """`keys` and every key their defaults copy, through chains (reward_model.use_dynamic_bsz -> critic's -> the
    actor's): a read of a key at its default is a read of its source."""
    sources, found = interpolation_sources(), set(keys)
    for key in keys:
        while key in sources:
            key = sources[key]
            found.add(key)
    return found


def _recording_copy(node, path: str, record_file: str):
    values = {name: _recording_copy(value, f"{path}{name}.", record_file)
              if dataclasses.is_dataclass(value) and not isinstance(value, type) else value
              for name, value in vars(node).items()}
    return _rebuild(type(node), path, record_file, values)


def _rebuild(schema, path: str, record_file: str, values: dict):
    """A node of `schema`'s recording subclass (`path`: its dotted prefix) holding `values`."""
    _keep_paths_through_replace()  # in a worker, the first node unpickled installs it there
    node = object.__new__(_recording_class(schema))
    node.__dict__.update(values)
    _tag(node, path, record_file)
    return node


def _tag(node, path: str, record_file: str) -> None:
    node.__dict__.update(_reads_path=path, _reads_file=record_file, _reads_seen=set())


def _recording_class(schema):
    return type(f"Recording{schema.__name__}", (schema,), {"__getattribute__": _getattribute, "__reduce__": _reduce})


def _getattribute(self, name):
    value = object.__getattribute__(self, name)
    if name.startswith("_") or name not in object.__getattribute__(self, "__dataclass_fields__"):
        return value
    tags = object.__getattribute__(self, "__dict__")
    if "_reads_path" in tags and "_reads_path" not in getattr(value, "__dict__", {}):
        _record(tags, tags["_reads_path"] + name, sys._getframe(1))
    return value


def _record(tags: dict, key: str, frame) -> None:
    """key read by `frame`'s code: written once per node and reading file, when that is pyrl's."""
    reader = frame.f_code.co_filename
    if reader.startswith(PYRL_DIR) and (key, reader) not in tags["_reads_seen"]:
        tags["_reads_seen"].add((key, reader))
        with open(tags["_reads_file"], "a") as f:
            f.write(f"{key} {reader[len(PYRL_DIR):]}\n")


def _reduce(self):
    state = object.__getattribute__(self, "__dict__")
    values = {name: value for name, value in state.items() if name not in TAGS}
    return _rebuild, (type(self).__mro__[1], state["_reads_path"], state["_reads_file"], values)


def _keep_paths_through_replace() -> None:
    """dataclasses.replace of a recording node: the copy records under the same path (pyrl's workers replace
    actor_rollout_ref.rollout to give each engine its seed)."""
    if getattr(dataclasses.replace, "keeps_read_paths", False):
        return
    original = dataclasses.replace

    def replace(obj, /, **changes):
        copy = original(obj, **changes)
        tags = getattr(obj, "__dict__", {})
        if "_reads_path" in tags:
            _tag(copy, tags["_reads_path"], tags["_reads_file"])
        return copy

    replace.keeps_read_paths = True
    replace.original = original
    dataclasses.replace = replace


def restore_replace() -> None:
    if getattr(dataclasses.replace, "keeps_read_paths", False):
        dataclasses.replace = dataclasses.replace.original


class RecordingOmegaConf(OmegaConf):
    """OmegaConf for pyrl.ppo: structured() of a recording section (data, for the datasets) gives a view recording
    the keys read from it; of the whole config (config.yaml), the DictConfig itself."""

    @staticmethod
    def structured(obj, *args, **kwargs):
        view = OmegaConf.structured(obj, *args, **kwargs)
        tags = getattr(obj, "__dict__", {})
        return DictConfigReads(view, tags) if tags.get("_reads_path") else view


class DictConfigReads:
    """A read-only DictConfig view of a recording node (attribute, item and get reads recorded)."""

    def __init__(self, view, tags: dict):
        object.__setattr__(self, "_view", view)
        object.__setattr__(self, "_tags", tags)

    def _read(self, key):
        if isinstance(key, str):
            _record(self._tags, self._tags["_reads_path"] + key, sys._getframe(2))

    def __getattr__(self, name):
        self._read(name)
        return getattr(self._view, name)

    def __getitem__(self, key):
        self._read(key)
        return self._view[key]

    def get(self, key, default=None):
        self._read(key)
        return self._view.get(key, default)
