"""``ddpjob doctor``: the cluster's settings that decide whether work survives (``checks``), the compute nodes as a job
sees them (``node_probe``), and a drill that preempts a real job and times its recovery (``drill``); each check is a
``findings.Finding`` with a stable key.
"""
