"""examples/dp_server.py with its per-step poll counted: the example's `poll_all` replaced by a
counter that calls it (a monkeypatch of the loaded module), the loop run as its main runs it,
then this rank's count written to OUT/polls<rank>.json. Exits with the loop's status.

    cd tests && torchrun --nproc-per-node 2 -m helpers.dp_server_polls OUT <dp_server arguments>
"""

import importlib.util
import json
import os
import sys

SERVER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "examples")
SERVER = os.path.join(SERVER, "dp_server.py")


def main() -> int:
    out, arguments = sys.argv[1], sys.argv[2:]
    spec = importlib.util.spec_from_file_location("dp_server", SERVER)
    server = importlib.util.module_from_spec(spec)
    sys.modules["dp_server"] = server  # dataclasses resolve their module by name
    spec.loader.exec_module(server)
    polls = []
    poll_all = server.poll_all

    def counted() -> None:
        polls.append(1)
        poll_all()

    server.poll_all = counted  # serve() looks the name up in its module at every step
    sys.argv = [SERVER, *arguments]
    status = server.main()
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"polls{rank}.json"), "w") as f:
        json.dump({"rank": rank, "polls": len(polls), "status": status}, f)
    return status


if __name__ == "__main__":
    sys.exit(main())
