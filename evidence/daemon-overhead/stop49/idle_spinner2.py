import os
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while True:
    pass
