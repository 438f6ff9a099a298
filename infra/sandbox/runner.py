"""The runner that lives *inside* a warm sandbox (stdlib only; runs on the sandbox's python3).

Why: starting a sandbox costs tens (bwrap) to hundreds (docker) of milliseconds, while a scoring job
is a few milliseconds of Python. So one sandbox serves many jobs, and each job must still start from
a clean state and be unable to forge its own score. Three processes, all the same non-root uid:

* **runner (R)** — PID 1 of the sandbox's PID namespace (bwrap ``--as-pid-1``; docker's command).
  The kernel never delivers SIGKILL/SIGSTOP to a namespace's init from inside that namespace, so the
  untrusted job cannot kill or stop it. R is non-dumpable (no ptrace, no ``/proc/1/mem`` or
  ``/proc/1/fd`` access for the job). R reads one JSON job per line on stdin and writes one JSON
  reply per line on stdout; the job never holds these fds.
* **zygote (Z)** — a fresh ``exec`` of python made at sandbox start, holding no job data. For each
  job it forks a worker, reports its pid and, after ``waitpid``, its exit status to R over a private
  socket (closed in the worker).
* **worker (W)** — the fork of Z that runs the untrusted program: new session, stdin ``/dev/null``,
  stdout/stderr/results on three pipes read by R, hard rlimits (address space, CPU, file size, fds,
  optionally processes), cwd the tmpfs scratch.

Results are *values*: W sends back what ``entry(*args)`` returned, as JSON, on fd 3. The expected
answers never enter the sandbox; the trusted host compares. A program that writes fake values to fd 3
only forges its own outputs, which is what it is graded on anyway.

After every job R kills W's process group, reaps orphans, lists ``/proc`` and reports an *anomaly*
if any process other than R and Z survived (then it kills them all with ``kill(-1)``; the host
retires the sandbox), and wipes the writable dirs (scratch, ``/dev/shm``).

Invocation (host side builds it): ``python3 -I -S -B -c "import sys;exec(sys.argv[1])" SOURCE MODE
OPTIONS_JSON``; MODE is ``--runner``, ``--zygote FD`` or ``--oneshot [JOB_JSON]`` (run one job and print the
reply: the no-pool baseline of the benchmark).
"""

import json
import os
import resource
import select
import shutil
import signal
import socket
import struct
import sys
import time

BOOT = "import sys;exec(sys.argv[1])"
MEM_MARK = b'{"phase":"memory"}'
_READ = 65536


# ------------------------------------------------------------------------------------- helpers
def _nondumpable():
    """PR_SET_DUMPABLE 0: same-uid processes may not ptrace us or open our /proc files."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except Exception:
        pass


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        view = view[n:]


def _send_line(obj):
    _write_all(1, json.dumps(obj, separators=(",", ":")).encode() + b"\n")


class _Tail:
    """Counts bytes and keeps the last ``keep`` of them."""

    def __init__(self, keep):
        self.keep = keep
        self.buf = bytearray()
        self.total = 0

    def add(self, data):
        self.total += len(data)
        self.buf += data
        if len(self.buf) > 2 * self.keep:
            del self.buf[: len(self.buf) - self.keep]

    def text(self):
        return bytes(self.buf[-self.keep :]).decode("utf-8", "replace") if self.keep else ""


def _oom_count():
    """The cgroup's oom_kill counter (v2 or v1), or -1 when not visible."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            with open(path) as fh:
                for line in fh:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            continue
    return -1


def _wipe(path):
    """Delete everything under ``path`` (making dirs writable first). Returns True if now empty."""
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return True
    except OSError:
        return False

    def onerror(func, p, exc):
        try:
            os.chmod(os.path.dirname(p) or p, 0o700)
            os.chmod(p, 0o700)
        except OSError:
            pass
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)
        except OSError:
            pass

    for e in entries:
        try:
            if e.is_dir(follow_symlinks=False):
                try:
                    os.chmod(e.path, 0o700)
                except OSError:
                    pass
                shutil.rmtree(e.path, onerror=onerror)
            else:
                os.unlink(e.path)
        except OSError:
            pass
    try:
        return not os.listdir(path)
    except OSError:
        return False


# -------------------------------------------------------------------------------- worker (W)
def _set_limits(opts, timeout):
    def hard(which, value):
        if value is None:
            return
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            pass

    hard(resource.RLIMIT_AS, opts.get("memory_bytes"))
    hard(resource.RLIMIT_CPU, int(timeout) + 2)
    hard(resource.RLIMIT_FSIZE, opts.get("fsize_bytes"))
    hard(resource.RLIMIT_NOFILE, opts.get("nofile", 256))
    hard(resource.RLIMIT_CORE, 0)
    hard(resource.RLIMIT_NPROC, opts.get("nproc"))


def _encode_value(value):
    try:
        return ["ok", json.loads(json.dumps(value))]
    except Exception:
        try:
            shown = repr(value)[:200]
        except Exception:
            shown = "<unrepresentable>"
        return ["unserializable", shown]


def _harness(job):
    """Run the job's program in this (worker) process; returns the exit status."""
    import builtins
    import traceback

    program = job["program"]
    glb = {"__name__": "__main__" if job["mode"] == "exec" else "__program__", "__builtins__": builtins}
    if job["mode"] == "exec":
        try:
            exec(compile(program, "<program>", "exec"), glb)
            return 0
        except SystemExit as exc:
            code = exc.code
            if code is None:
                return 0
            if isinstance(code, int):
                return code & 0xFF
            try:
                sys.stderr.write(str(code) + "\n")
            except Exception:
                pass
            return 1
        except MemoryError:
            os.write(3, MEM_MARK)
            return 1
        except BaseException:
            traceback.print_exc()
            return 1

    def report(obj):
        _write_all(3, json.dumps(obj, separators=(",", ":")).encode())

    try:
        code = compile(program, "<program>", "exec")
    except (SyntaxError, ValueError) as exc:
        report({"phase": "syntax", "msg": str(exc)[:500]})
        return 0
    try:
        exec(code, glb)
    except MemoryError:
        os.write(3, MEM_MARK)
        return 1
    except BaseException:
        traceback.print_exc()
        report({"phase": "load_error"})
        return 1
    fn = glb.get(job["entry"])
    if not callable(fn):
        report({"phase": "no_entry", "msg": "no callable named %r" % job["entry"]})
        return 1
    results = []
    try:
        for args in job["args"]:
            try:
                value = fn(*args)
            except MemoryError:
                raise
            except Exception as exc:
                results.append(["exception", type(exc).__name__])
                continue
            results.append(_encode_value(value))
    except MemoryError:
        results = None
        os.write(3, MEM_MARK)
        return 1
    report({"phase": "done", "results": results})
    return 0


def _worker_main(job, fds, opts):
    """Body of the forked worker: isolate, limit, run, ``_exit``. Never returns."""
    status = 1
    try:
        os.setsid()
        high = [os.dup(f) for f in fds]  # dup first: a received fd may sit on 0..3
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        for target, fd in zip((1, 2, 3), high):
            os.dup2(fd, target)
        os.closerange(4, 1 << 16)  # includes the zygote's socket: the job cannot talk to R
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        _set_limits(opts, float(job["timeout"]))
        os.chdir(opts["scratch"])
        import io
        import threading

        threading.stack_size(1 << 20)  # thread stacks count against RLIMIT_AS: keep them small

        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        status = _harness(job)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
    except MemoryError:
        try:
            os.write(3, MEM_MARK)
        except OSError:
            pass
    except BaseException:
        pass
    os._exit(status)


# ------------------------------------------------------------------------------- zygote (Z)
def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def zygote_main(fd, opts):
    """Fork one worker per job message; report ``P pid`` then ``X pid status`` to the runner."""
    _nondumpable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Warm the modules scoring programs commonly import, so a worker pays nothing for them.
    for name in ("math", "re", "itertools", "functools", "collections", "random", "string",
                 "heapq", "bisect", "fractions", "statistics", "typing", "io", "traceback", "builtins",
                 "threading"):
        try:
            __import__(name)
        except Exception:
            pass
    # Freeze the heap: a forked worker then never has its collector walk (and so write to, and so
    # copy-on-write fault) the pages of every object inherited from us. ~40% of a short job's time.
    import gc

    gc.collect()
    gc.freeze()
    sock = socket.socket(fileno=fd)
    sock.sendall(b"R")  # ready: the runner waits for this, so a job never pays our start-up
    while True:
        try:
            head, fds, _flags, _addr = socket.recv_fds(sock, 8, 3)
            if not head:
                os._exit(0)
            if len(head) < 8:
                head += _recv_exact(sock, 8 - len(head))
            (size,) = struct.unpack("<Q", head)
            job = json.loads(_recv_exact(sock, size))
        except (EOFError, OSError, ValueError):
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            sock.close()
            _worker_main(job, fds, opts)
        for f in fds:
            os.close(f)
        sock.sendall(b"P" + struct.pack("<q", pid))
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        sock.sendall(b"X" + struct.pack("<qq", pid, status))


def _drain(readers, open_fds, cap):
    """Read what is already buffered in the still-open pipes without blocking (orphans may keep a
    pipe open: never wait for EOF), at most ``cap`` bytes a pipe."""
    for fd in list(open_fds):
        try:
            os.set_blocking(fd, False)
            while True:
                data = os.read(fd, _READ)
                if not data:
                    break
                readers[fd].add(data)
                if readers[fd].total > cap:
                    break
        except (BlockingIOError, OSError):
            pass


# ------------------------------------------------------------------------------- runner (R)
class Runner:
    """The trusted per-sandbox loop (see the module docstring)."""

    def __init__(self, source, opts):
        self.source = source
        self.opts = opts
        self.pid1 = os.getpid() == 1
        self.zpid = None
        self.zsock = None
        self.zbuf = b""

    # zygote management
    def spawn_zygote(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [sys.executable, "-I", "-S", "-B", "-c", BOOT, self.source, "--zygote",
                str(theirs.fileno()), json.dumps(self.opts)]
        pid = os.fork()
        if pid == 0:
            try:
                null = os.open("/dev/null", os.O_RDWR)
                for target in (0, 1, 2):
                    os.dup2(null, target)
                keep = theirs.fileno()
                os.closerange(3, keep)
                os.closerange(keep + 1, 1 << 16)
                os.set_inheritable(keep, True)
                os.execv(sys.executable, argv)
            finally:
                os._exit(127)
        theirs.close()
        self.zpid, self.zsock, self.zbuf = pid, ours, b""
        ready, _, _ = select.select([ours], [], [], 60.0)
        if not ready or ours.recv(1) != b"R":
            raise RuntimeError("zygote did not start")

    def _zmsg(self):
        """Parse one complete zygote message from the buffer, or None."""
        if self.zbuf[:1] == b"P" and len(self.zbuf) >= 9:
            msg = ("P", struct.unpack("<q", self.zbuf[1:9])[0], None)
            self.zbuf = self.zbuf[9:]
            return msg
        if self.zbuf[:1] == b"X" and len(self.zbuf) >= 17:
            pid, status = struct.unpack("<qq", self.zbuf[1:17])
            self.zbuf = self.zbuf[17:]
            return ("X", pid, status)
        return None

    def _recv_zmsgs(self):
        """Read what the zygote sent (one recv) and return the complete messages in it, or None
        when the zygote closed its socket."""
        data = self.zsock.recv(64)
        if not data:
            return None
        self.zbuf += data
        msgs = []
        msg = self._zmsg()
        while msg is not None:
            msgs.append(msg)
            msg = self._zmsg()
        return msgs

    # process hygiene
    def _reap(self):
        """Reap every exited child/orphan without blocking; note if the zygote died."""
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.zpid:
                self.zpid = None

    def _strays(self):
        """Pids in our namespace other than R and Z (only meaningful as PID 1)."""
        keep = {1, os.getpid(), self.zpid}
        out = []
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) not in keep:
                try:
                    with open("/proc/%s/stat" % name) as fh:
                        if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                            continue  # zombie not yet reaped
                except (OSError, IndexError):
                    continue
                out.append(int(name))
        return out

    def _kill_all(self):
        """kill(-1): every process of the namespace except R dies (only as PID 1)."""
        for _ in range(100):
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
            while True:
                try:
                    os.waitpid(-1, 0)
                except ChildProcessError:
                    break
                except InterruptedError:
                    continue
            if not self._strays():
                break
        self.zpid = None
        if self.zsock is not None:
            self.zsock.close()
            self.zsock = None

    # one job
    def run_job(self, job):
        """Run one job in a fresh worker forked by the zygote; return the reply dict."""
        opts = self.opts
        timeout = float(job.get("timeout") or 2.0)
        limit = int(opts["output_limit"])
        payload_limit = int(opts.get("payload_limit", 1 << 22))
        tail = int(opts.get("tail_bytes", 4096))
        oom_before = _oom_count()
        if self.zpid is None:
            self.spawn_zygote()
        t0 = time.monotonic()
        reply = {"id": job.get("id"), "exit": None, "signal": None, "timed_out": False,
                 "output_limit": False, "oom": False, "anomaly": None}
        pipes = self._dispatch(job, timeout, reply)
        if pipes is None:
            return reply
        readers = {pipes[0][0]: _Tail(tail), pipes[1][0]: _Tail(tail), pipes[2][0]: _Tail(payload_limit)}
        open_fds = set(readers)
        wpid, status, t_exit = self._pump(readers, open_fds, pipes, t0 + timeout, reply)
        if status is None or status == -1:
            t_exit = time.monotonic()
            status = self._stop_worker(wpid)
            if status is None:
                reply["anomaly"] = reply["anomaly"] or "worker status lost"
        _drain(readers, open_fds, 4 * max(limit, payload_limit))
        for r, _ in pipes:
            os.close(r)
        if status is not None and status >= 0:
            if os.WIFSIGNALED(status):
                reply["signal"] = os.WTERMSIG(status)
            elif os.WIFEXITED(status):
                reply["exit"] = os.WEXITSTATUS(status)
        out, err, res = (readers[p[0]] for p in pipes)
        if out.total + err.total > limit:
            reply["output_limit"] = True
        reply["stdout"], reply["stderr"] = out.text(), err.text()
        reply["stdout_bytes"], reply["stderr_bytes"] = out.total, err.total
        reply["payload"] = bytes(res.buf).decode("utf-8", "replace") if res.total <= payload_limit else None
        reply["run_s"] = (t_exit or time.monotonic()) - t0
        self._clean_up(reply)
        oom_after = _oom_count()
        reply["oom"] = oom_before >= 0 and oom_after > oom_before
        return reply

    def _dispatch(self, job, timeout, reply):
        """Hand the job and the write ends of three fresh pipes (stdout, stderr, results) to the
        zygote. Returns the pipes, or None (with ``reply["anomaly"]`` set) if the zygote is gone."""
        pipes = [os.pipe() for _ in range(3)]
        body = json.dumps({"mode": job.get("mode", "exec"), "program": job.get("program", ""),
                           "entry": job.get("entry", ""), "args": job.get("args", []),
                           "timeout": timeout}).encode()
        try:
            socket.send_fds(self.zsock, [struct.pack("<Q", len(body))], [w for _, w in pipes])
            self.zsock.sendall(body)
        except OSError as exc:
            for r, w in pipes:
                os.close(r)
                os.close(w)
            reply["anomaly"] = "zygote unreachable: %s" % exc
            self._kill_all()
            return None
        for _, w in pipes:
            os.close(w)
        return pipes

    def _pump(self, readers, open_fds, pipes, deadline, reply):
        """Read the worker's pipes and the zygote's messages until the worker's exit status
        arrives, the deadline passes or an output limit is crossed. Returns (worker pid, exit
        status or None, or -1 when the zygote died; time of exit or None)."""
        limit = int(self.opts["output_limit"])
        payload_limit = readers[pipes[2][0]].keep
        wpid = status = t_exit = None
        zfd = self.zsock.fileno()
        while status is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                reply["timed_out"] = True
                break
            try:
                ready, _, _ = select.select(list(open_fds) + [zfd], [], [], remaining)
            except InterruptedError:
                continue
            for fd in ready:
                if fd == zfd:
                    msgs = self._recv_zmsgs()
                    if msgs is None:
                        reply["anomaly"] = "zygote died"
                        status = -1
                        break
                    for kind, pid, st in msgs:
                        if kind == "P":
                            wpid = pid
                        else:
                            status, t_exit = st, time.monotonic()
                    continue
                data = os.read(fd, _READ)
                if not data:
                    open_fds.discard(fd)
                else:
                    readers[fd].add(data)
            if readers[pipes[0][0]].total + readers[pipes[1][0]].total > limit:
                reply["output_limit"] = True
                break
            if readers[pipes[2][0]].total > payload_limit:
                reply["output_limit"] = True
                break
        return wpid, status, t_exit

    def _stop_worker(self, wpid):
        """SIGKILL the worker and its process group, then collect its exit status from the zygote
        (at most 2 s). Returns the status, or None if it was lost."""
        if wpid:
            for target in (-wpid, wpid):
                try:
                    os.kill(target, signal.SIGKILL)
                except OSError:
                    pass
        status = None
        end = time.monotonic() + 2.0
        while status is None and self.zsock is not None and time.monotonic() < end:
            zfd = self.zsock.fileno()
            ready, _, _ = select.select([zfd], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                break
            msgs = self._recv_zmsgs()
            if msgs is None:
                break
            for kind, _, st in msgs:
                if kind == "X":
                    status = st
        return status

    def _clean_up(self, reply):
        """Leave a clean state for the next job: reap, kill every stray process of the namespace
        (an anomaly: the host retires the sandbox), wipe the writable folders."""
        self._reap()
        if self.pid1:
            strays = self._strays()
            if strays or self.zpid is None:
                if strays:
                    reply["anomaly"] = reply["anomaly"] or "%d process(es) outlived the job" % len(strays)
                self._kill_all()
        for path in self.opts.get("wipe", []):
            if not _wipe(path):
                reply["anomaly"] = reply["anomaly"] or "could not wipe %s" % path

    def serve(self):
        stdin = sys.stdin.buffer
        self.spawn_zygote()
        _send_line({"ready": True, "pid1": self.pid1, "uid": os.getuid(),
                    "python": sys.version.split()[0]})
        while True:
            line = stdin.readline()
            if not line:
                return
            try:
                job = json.loads(line)
            except ValueError:
                _send_line({"fatal": "bad job line"})
                continue
            try:
                reply = self.run_job(job)
            except Exception as exc:  # report, never die silently
                reply = {"id": job.get("id"), "fatal": "%s: %s" % (type(exc).__name__, exc),
                         "anomaly": "runner error"}
            _send_line(reply)


def oneshot_main(opts, job_text=None):
    """Run one job (JSON on stdin) in a forked worker of this fresh process; print the reply.

    The no-pool baseline: a new sandbox per job pays start-up, this one job, and teardown.
    """
    job = json.loads(job_text if job_text is not None else sys.stdin.buffer.read())
    job["timeout"] = float(job.get("timeout") or 2.0)
    tail = int(opts.get("tail_bytes", 4096))
    pipes = [os.pipe() for _ in range(3)]
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        for r, _ in pipes:
            os.close(r)
        _worker_main(job, [w for _, w in pipes], opts)
    for _, w in pipes:
        os.close(w)
    tails = {pipes[0][0]: _Tail(tail), pipes[1][0]: _Tail(tail),
             pipes[2][0]: _Tail(int(opts.get("payload_limit", 1 << 22)))}
    open_fds = set(tails)
    deadline = t0 + job["timeout"]
    reply = {"id": job.get("id"), "exit": None, "signal": None, "timed_out": False,
             "output_limit": False, "oom": False, "anomaly": None}
    status = None
    while status is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            reply["timed_out"] = True
            break
        ready, _, _ = select.select(list(open_fds), [], [], min(remaining, 0.05)) if open_fds else \
            (time.sleep(min(remaining, 0.005)) or [], [], [])
        for fd in ready:
            data = os.read(fd, _READ)
            if data:
                tails[fd].add(data)
            else:
                open_fds.discard(fd)
        if tails[pipes[0][0]].total + tails[pipes[1][0]].total > int(opts["output_limit"]):
            reply["output_limit"] = True
            break
        if not open_fds or not ready:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
    if status is None:
        for target in (-pid, pid):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError:
                pass
        _, status = os.waitpid(pid, 0)
    reply["run_s"] = time.monotonic() - t0
    if os.WIFSIGNALED(status):
        reply["signal"] = os.WTERMSIG(status)
    elif os.WIFEXITED(status):
        reply["exit"] = os.WEXITSTATUS(status)
    out, err, res = (tails[p[0]] for p in pipes)
    reply["stdout"], reply["stderr"] = out.text(), err.text()
    reply["payload"] = bytes(res.buf).decode("utf-8", "replace")
    _send_line(reply)


def main(argv):
    mode = argv[2] if len(argv) > 2 else "--runner"
    if mode == "--zygote":
        zygote_main(int(argv[3]), json.loads(argv[4]))
    elif mode == "--oneshot":
        oneshot_main(json.loads(argv[3]), argv[4] if len(argv) > 4 else None)
    else:
        _nondumpable()
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os.chdir("/")
        Runner(argv[1], json.loads(argv[3])).serve()


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[0] == "-c":
    main(sys.argv)
