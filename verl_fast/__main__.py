from verl_fast.cli.main import program

program()
