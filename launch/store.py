"""The key-value store of a process group (torch.distributed's rendezvous store: a TCPStore, or
a HashStore for one process), on a connection of our own.

The library's host messages go through it, not through the group's gloo connections: a wait on
the store that times out leaves it usable (a gloo wait that times out closes every connection
of its group), and the user's collectives on the group are never interleaved with ours. A
connection of our own (`clone()`) keeps our timeouts apart from those of the store the process
group uses.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def group_store(group: dist.ProcessGroup, call_s: float) -> dist.Store:
    """A new connection to `group`'s store whose calls give up after `call_s` seconds with
    torch.distributed.DistStoreError (a `wait(keys, timeout)` takes its own). Local (no
    collective)."""
    try:
        store = c10d._world.pg_map[group][1]
    except (AttributeError, KeyError, IndexError, TypeError):
        store = c10d._get_default_store()
    if store is None:
        raise RuntimeError(
            "group_store: torch.distributed has no rendezvous store for this group (initialise it"
            " with init_process_group before building an EpRouted)"
        )
    try:
        store = store.clone()
    except (AttributeError, RuntimeError):  # a store without clone() (HashStore): shared
        pass
    store.set_timeout(datetime.timedelta(seconds=call_s))
    return store


def give_up(store: dist.Store, key: str, counter: int, complete: int, mark: int, unit: int):
    """Add `mark` (a multiple of `unit`) to the arrivals' counter at `key` by compare-and-set,
    and only while it reads neither `complete` nor a give-up (a value >= `unit`): so a give-up
    comes before the last arrival or not at all, and only the first one counts. `counter`: the
    counter as last read. Returns (the counter as this call left it, whether this call set the
    give-up). LookupError when the key is gone (compare_set then gives back the expected
    value). The host barriers' give-up (comm/host_channel.py) and new_dep_group's."""
    while counter < unit and counter != complete:
        seen = int(store.compare_set(key, str(counter), str(counter + mark)))
        if seen == counter + mark:
            return seen, True
        if seen == counter:
            raise LookupError(f"{key}: the counter is gone")
        counter = seen  # an arrival or another give-up came meanwhile: look again
    return counter, False


def group_name(group: dist.ProcessGroup) -> str:
    """The name every rank of `group` knows it by (torch gives groups names agreed by all)."""
    return str(group.group_name)
