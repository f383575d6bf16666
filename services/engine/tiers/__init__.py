"""The engine's own tier: chunks resident in its memory pool (`LocalCPUBackend`, cpu.py).

The lower tiers are the disk and remote stores, reached through their clients
(services/disk_store/client.py, services/remote_store/client.py).
"""
