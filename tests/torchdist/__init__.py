import os

JOB_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_job.py")
