"""Example tasks that ship with ddpjob; each trains on data that comes inside an installed package."""
