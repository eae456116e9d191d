"""Peer clients."""
