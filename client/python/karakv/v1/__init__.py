"""Generated messages and stubs of karakv.v1 (karakv_pb2, karakv_pb2_grpc), made from proto/ when
the package is built."""
