"""kvtier.integrations: serving engines driving kvtier (the top layer beside tools).

Imports flow integrations -> engine -> tiers -> policy; nothing below imports this package.
Each integration lives in its own subpackage and imports its serving engine only there, so
``import kvtier.integrations`` never pulls a serving engine in.
"""
