"""Kopf hands each index to handlers under its function's name: Inventory.from_kopf must ask for
exactly the names handlers.fleetindex defines (a rename would otherwise fail only at run time)."""

from __future__ import annotations

import inspect

from sparsegate.controllers.inventory import Inventory
from sparsegate.handlers import fleetindex


def test_inventory_reads_the_indexes_fleetindex_defines() -> None:
    defined = {name for name, fn in inspect.getmembers(fleetindex, inspect.isfunction)
               if fn.__module__ == fleetindex.__name__}
    asked: list[str] = []

    class Recorder(dict):
        def __getitem__(self, key: str) -> dict:
            asked.append(key)
            return {}

    inventory = Inventory.from_kopf(Recorder())
    assert set(asked) == defined and len(asked) == 5
    assert inventory.model("ns", "m") is None and inventory.pods("ns", "m") == []
    assert inventory.gate("ns", "g") is None
