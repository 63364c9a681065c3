"""The core: definition (modules, variables) -> plan (one walk) -> call (frames).

Which core file may import which, bottom to top (a file imports only files earlier in
this list, never a later one, not even inside a function):

1. types: the type aliases.
2. errors: the exception classes.
3. checks: argument checks, how messages write paths, the rule of casts into a variable.
4. copying: how model objects are copied and pickled.
5. initializer: `Initializer` and `from_jax` (checks).
6. recording: what a call records when asked (checks, errors).
7. frame: the active call (checks, errors, types); `frame.Declaration` marks declarations.
8. rng: random streams (errors, frame).
9. variables: declarations (checks, copying, frame, initializer, types).
10. module: `Module` (checks, copying, errors, frame, initializer, variables).
11. casting: the casts a mixed-precision policy puts around a module's call (none of these).
12. graph: the walk and the plan (checks, module, types, variables).
13. layout: the variables dict checked against a plan (checks, errors, graph).
14. transform: transform, init, apply, assign_variables (all of the above).
"""
