"""What every converter shares: the items it plans, the problems it reports, its interface.

A conversion has two phases. `plan` runs once, in the main process: it reads the source's index
(a JSON, a TSV, caption files, .npy headers) and lists every sample to write as an `Item`, in a
fixed order, without touching images or feature rows. `worker(setup)` then runs in each worker
process and turns lists of items into samples. Keeping plan and work apart is what makes the
output deterministic (shard i always holds the same items) and resumable shard by shard.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ON_ERROR = ("stop", "skip")


class BadInput(Exception):
    """One problem in the source data: `where` names the file (and line or item), `what` says
    what is wrong and, when it helps, what to do."""

    def __init__(self, where: str, what: str):
        super().__init__(where, what)
        self.where, self.what = where, what

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


class Problems:
    """Bad input met while planning. Under `stop` the first one ends the conversion; under `skip`
    each is recorded, and the skipped list is printed and written beside the shards."""

    def __init__(self, on_error: str):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, not {on_error!r}")
        self.on_error = on_error
        self.skipped: list[dict] = []

    def report(self, where: str, what: str, key: str | None = None, split: str | None = None) -> None:
        if self.on_error == "stop":
            raise BadInput(where, what)
        self.skipped.append(skip_record(key, split, BadInput(where, what)))


def skip_record(key: str | None, split: str | None, problem: BadInput) -> dict:
    return {"split": split, "key": key, "where": problem.where, "problem": problem.what}


@dataclass
class Item:
    """One sample to write. `key` is its key in the shards, `where` names its source for messages,
    `captions` are its texts (the train ones build vocab.json), `data` is what the worker needs
    (paths, row numbers, metadata); all plain JSON values, since items are fingerprinted."""

    key: str
    split: str
    where: str
    captions: list[str]
    data: dict = field(default_factory=dict)

    def as_json(self) -> list:
        return [self.key, self.split, self.where, self.captions, self.data]


@dataclass
class Plan:
    splits: dict[str, list[Item]]  # split -> items in output order
    inputs: dict[str, Any]  # what identifies the source: dataset name, index files' sha256
    features: dict | None = None  # manifest["features"] when samples carry regions.npy
    prepare: Callable[[], Any] = lambda: None  # -> the worker setup; run only if shards remain
    skipped: list[dict] = field(default_factory=list)  # problems met while planning (under skip)


SampleMaker = Callable[[list[Item]], "list[dict | BadInput]"]


class Converter:
    """One source format. Subclasses set `name`, `version` and `summary`, and implement
    add_arguments, plan and worker. Bump `version` whenever the samples written change."""

    name: str = ""
    version: int = 1
    summary: str = ""

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Format-specific options (`--src` and the common ones are added by the CLI)."""

    @classmethod
    def options(cls, args: argparse.Namespace) -> dict:
        """The options that shape the output: stored in the manifest and in the fingerprint."""
        return {}

    @classmethod
    def plan(cls, args: argparse.Namespace, problems: Problems) -> Plan:
        raise NotImplementedError

    @classmethod
    def worker(cls, setup: Any) -> SampleMaker:
        """Runs in a worker process: returns a function from items to samples (dicts of members
        without `__key__`) or BadInput, one per item, in order."""
        raise NotImplementedError
