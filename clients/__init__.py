"""Clients of the server's APIs."""
