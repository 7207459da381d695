"""tasks: the Task API (``base``: ``Task``, ``Output``, the loader that finds a task by ``task.target``) and the
tasks that ship with ddpjob (``digits``, ``charlm``, ``hf_gpt2``), each training on data inside an installed
package. Users import the API as ``ddp_core.task``."""
