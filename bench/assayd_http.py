"""What the benchmark scripts need of assayd's API over its unix socket (standard library only):
a JSON request, waiting until it answers, waiting for jobs to end (exits unless they succeed)."""
import http.client, json, socket, sys, time


def call(sock, method, target, body=None):
    class Unix(http.client.HTTPConnection):
        def connect(self):
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.connect(sock)
    c = Unix("localhost")
    c.request(method, target, body=json.dumps(body) if body else None,
              headers={"Content-Type": "application/json"})
    r = c.getresponse(); data = r.read(); c.close()
    return r.status, json.loads(data)


def wait_healthy(sock, seconds=10):
    for _ in range(int(seconds / 0.05)):
        try:
            if call(sock, "GET", "/v1/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    sys.exit("assayd on %s did not answer" % sock)


def wait_jobs(sock, ids):
    pending = set(ids)
    while pending:
        for i in list(pending):
            s = call(sock, "GET", "/v1/jobs/" + i)[1]["state"]
            if s in ("succeeded", "failed", "cancelled"):
                if s != "succeeded":
                    sys.exit("job %s %s" % (i, s))
                pending.discard(i)
        time.sleep(0.05)
