        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
`        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
k        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
v        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
`        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
:        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
v        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
y        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
v        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
w        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
v        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
N        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
A        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
T        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
S        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
;        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
S        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
I        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
G        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
T        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
E        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
R        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
M        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
w        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
5        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
y        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
j        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
g        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
b        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
y        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
b        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
P        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
k        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
v        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
b        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
k        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
v        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
b        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
k        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
v        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
v        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
g        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
b        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
v        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
w        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
y        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
:        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
x        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
:        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
:        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
3        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
0        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
0        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
>        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
:        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
w        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
b        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
y        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
:        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
+        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
w        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
T        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
:        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
w        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
g        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
w        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
0        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
5        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
>        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
x        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
>        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
:        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
y        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
:        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
w        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
:        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
P        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
>        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
N        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
:        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
[        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
y        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
x        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
b        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
k        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
v        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
1        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
2        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
7        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
0        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
0        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
1        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
k        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
/        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
k        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
k        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
z        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
0        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
1        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
z        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
0        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
1        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
g        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
/        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
g        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
]        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
b        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
P        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
b        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
P        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
I        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
P        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
E        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
x        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
T        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
w        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
y        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
:        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
k        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
v        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
g        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
;        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
g        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
:        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
{        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
/        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
'        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
g        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
'        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
g        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
b        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
'        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
*        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
'        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
}        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
j        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
y        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
[        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
]        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
x        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
3        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
v        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
v        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
v        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
[        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
k        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
]        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
[        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
[        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
]        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
]        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
g        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
g        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
S        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
I        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
G        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
T        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
E        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
R        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
M        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
w        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
5        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
0        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
<        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
5        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
:        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
w        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
1        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
,        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
v        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
{        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
}        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
g        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
:        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
#        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
y        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
v        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
'        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
b        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
g        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
;        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
b        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
g        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
P        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
h        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
/        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
/        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
{        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
}        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
/        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
x        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
m        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
_        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
x        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
=        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
c        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
:        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
A        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
E        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
-        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
v        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
{        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
d        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
}        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
r        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
g        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
"        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
y        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
:        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
f        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
s        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
N        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
o        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
n        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
e        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
:        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
k        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
l        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
         with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
u        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
p        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
.        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
w        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
a        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
i        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
t        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
(        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
)        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()

        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
