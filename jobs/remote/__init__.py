"""``ddpjob --host NAME ...``: every command run against a cluster reached over SSH, from a laptop.

This package owns the laptop's side: the host file (``hosts``: which SSH host, remote directory and remote ddpjob a
name stands for), the one SSH gateway (``ssh``: the system ``ssh`` with a persistent connection, and ``rsync`` over
it), the staging of what a submission sends (``staging``: the config files and the code snapshot, into a folder of
the remote that only this submission uses), and the forwarding of each command (``forward``): checked here where it
can be, sent, run by the remote ddpjob with its output, exit status and one-line errors as they are on the login
node. See docs/remote.md.
"""
