"""``python -m engine.train``: one training job; the loop and its start are engine/training/."""
from engine.training.launch import run_and_exit

if __name__ == "__main__":
    run_and_exit()
