"""What Ray runs as its Python in the tests' shared Ray instance (see worker_template.py): a worker's script forked
from the template, this process waiting for it and ending as it ends; any other Python command run as it is."""

import json
import os
import signal
import socket
import sys

python, template, *argv = sys.argv[1:]
if not argv or os.path.basename(argv[0]) not in ("setup_worker.py", "default_worker.py"):
    os.execv(python, [python, *argv])
connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
connection.connect(template)
request = dict(argv=[python, *argv], cwd=os.getcwd(), env=dict(os.environ))
socket.send_fds(connection, [json.dumps(request).encode()], [1, 2])
pid = int(connection.recv(64))
for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(signum, lambda signum, frame: os.kill(pid, signum))
code = int(connection.recv(64) or -signal.SIGKILL)  # nothing: the template itself ended
if code < 0:  # ended by a signal: end by it too
    if -code not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code)
