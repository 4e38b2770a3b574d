"""One rank of a cluster job: writes what node it is on, and what the other ranks said over MPI,
to <out>/rank<r>.json (argv[1]: out directory)."""
import json
import os
import socket
import sys

from mpi4py import MPI

from deepfreeze import node

comm = MPI.COMM_WORLD
me = {"rank": comm.rank, "size": comm.size, "host": socket.gethostname(), "node": node.node_id(),
      "boot": node.boot_id(), "pid_ns": os.readlink("/proc/self/ns/pid"), "net_ns": os.readlink("/proc/self/ns/net")}
me["gathered"] = comm.allgather(me["node"])
path = os.path.join(sys.argv[1], f"rank{comm.rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump(me, f)
os.rename(path + ".tmp", path)
