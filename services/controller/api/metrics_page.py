"""GET /metrics: the controller's figures in the Prometheus text exposition format, rendered by hand.

The counters and histograms the core updates are `Metrics` (metrics.py); the index and ingest figures are read
from the ProducerTable at scrape time, so nothing is counted twice.
"""

from __future__ import annotations

from kvmesh.services.controller.core import ControllerCore


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(core: ControllerCore) -> str:
    """The whole /metrics page."""
    m, table = core.metrics, core.table
    stats = table.stats
    producers = list(table.producers.values())
    out: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float | int]]) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            out.append(f"{name}{{{labels}}} {value}" if labels else f"{name} {value}")

    metric("kvmesh_controller_index_keys", "gauge", "Distinct chunk keys in the index.", [("", len(table.index))])
    metric("kvmesh_controller_producer_keys", "gauge", "Keys held per producer (alive or not).",
           [(f'producer="{_escape(p.producer_id)}",kind="{p.kind}",location="{p.location or ""}"',
             table.index.count(p.slot)) for p in producers])
    metric("kvmesh_controller_producers", "gauge", "Known producers by liveness.",
           [('state="up"', sum(p.alive for p in producers)), ('state="down"', sum(not p.alive for p in producers))])
    metric("kvmesh_controller_instances", "gauge", "Registered engine instances.", [("", len(table.instances))])
    metric("kvmesh_controller_events_total", "counter", "NATS messages ingested by type.",
           [('type="admission_batch"', stats.batches), ('type="sync_chunk"', stats.sync_parts),
            ('type="heartbeat"', stats.heartbeats), ('type="register"', stats.registrations)])
    metric("kvmesh_controller_seq_gaps_total", "counter", "Sequence gaps detected (each triggers a full sync).",
           [("", stats.seq_gaps)])
    metric("kvmesh_controller_syncs_total", "counter", "Full syncs by outcome (limited: heartbeats of unknown "
           "producers past their principal's --sync-requests-per-principal, no request sent).",
           [('outcome="completed"', stats.syncs_completed), ('outcome="broken"', stats.syncs_broken),
            ('outcome="requested"', core.sync_requests_sent()), ('outcome="limited"', core.sync_requests_limited())])
    metric("kvmesh_controller_stale_keys_dropped_total", "counter", "Keys removed by full syncs.",
           [("", stats.stale_keys_dropped)])
    metric("kvmesh_controller_bad_messages_total", "counter", "Undecodable NATS messages dropped.",
           [("", core.bad_messages())])
    metric("kvmesh_controller_forged_messages_total", "counter",
           "NATS messages refused because their body disagrees with their sender (docs/security.md).",
           [("", core.forged_messages())])
    metric("kvmesh_controller_instance_conflicts_total", "counter",
           "Registrations that found another live worker claiming the same instance id and rank (reported).",
           [("", core.instance_conflicts())])
    metric("kvmesh_controller_registrations_refused_total", "counter",
           "Registrations refused for a limit (--max-producers, --min/--max-chunk-size, --max-key-param-sets, "
           "host/ip length), or naming a sharing domain the domains map does not give the principal (domain).",
           [(f'reason="{reason}"', n) for reason, n in sorted(stats.registrations_refused.items())])
    metric("kvmesh_controller_keys_refused_total", "counter",
           "Admitted chunk keys not indexed: their principal's producers hold --max-keys-per-principal.",
           [("", stats.keys_refused)])
    metric("kvmesh_controller_producers_forgotten_total", "counter",
           "Producers forgotten after --producer-expiry-secs down (keys dropped, slot reused).",
           [("", stats.producers_forgotten)])
    stream = core.kv_events
    if stream is not None:  # --kv-events-port
        metric("kvmesh_controller_kv_events_total", "counter",
               "The KV event stream: messages published, block hashes in them, replays served, chunk "
               "descriptions refused (malformed, over the bounds, or of keys not admitted).",
               [('what="messages"', stream.messages_published), ('what="hashes"', stream.hashes_published),
                ('what="replays"', stream.replays_served),
                ('what="descriptions_refused"', stream.descriptions.refused)])
    metric("kvmesh_controller_lookups_total", "counter", "Lookups answered.", [("", m.lookups)])
    metric("kvmesh_controller_peer_lookups_total", "counter",
           "P2P lookups of engine workers answered, by whether a live peer was named.",
           [(f'answer="{answer}"', core.peer_lookups(answer)) for answer in ("peer", "none")])
    metric("kvmesh_controller_lookup_hits_total", "counter", "Lookups matching at least one instance.",
           [("", m.lookup_hits)])
    out.append("# HELP kvmesh_controller_lookup_seconds Lookup time in the controller (hashing and index probes).")
    out.append("# TYPE kvmesh_controller_lookup_seconds histogram")
    out.extend(m.lookup_seconds.render("kvmesh_controller_lookup_seconds"))
    metric("kvmesh_controller_commands_total", "counter", "pin/unpin/clear commands by outcome.",
           [(f'op="{op}",outcome="{outcome}"', n) for (op, outcome), n in sorted(m.commands.items())])
    out.append("# HELP kvmesh_controller_command_seconds Command round trip to the workers.")
    out.append("# TYPE kvmesh_controller_command_seconds histogram")
    out.extend(m.command_seconds.render("kvmesh_controller_command_seconds"))
    metric("kvmesh_controller_tracked_events", "gauge", "Event ids /check_finish currently remembers, by window.",
           [('window="commands"', len(core.events)), ('window="lookups"', len(core.lookup_events))])
    metric("kvmesh_controller_commands_in_flight", "gauge", "pin/unpin/clear requests awaiting their workers.",
           [("", core.commands_in_flight)])
    metric("kvmesh_controller_nats_connected", "gauge", "1 when connected to NATS.",
           [("", int(core.nats_connected()))])
    return "\n".join(out) + "\n"
