"""NATS plumbing: connecting and serving on the bus, who may say what on it, its credentials and sharing domains.
Modules here import the nats-py package as `nats` (absolute imports: this folder is not named after it).

    bus.py               connecting, typed request handlers, typed requests
    nats_url.py          NATS URLs as KVMesh takes them (one server, or a cluster's)
    nats_auth.py         NATS credentials from the services' flags and variables
    nats_permissions.py  what each principal may publish and subscribe on
    credentials.py       a mesh's credentials directory: one user per principal, the server config they make
    embedded_nats.py     the embedded nats-server, run as a child
    sharing_domains.py   which sharing domain each engine principal is in, as stores and the controller see it
    admissions.py        producers' admission/eviction reports to the controller (CPU tier, disk and remote stores)
"""
