from verl_fast.cli import program

program()
