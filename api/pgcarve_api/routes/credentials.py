from fastapi import APIRouter, Response

from pgcarve_api.deps import MutationAuth, ServiceDep
from pgcarve_api.schemas import CredentialsOut

# A secret: the token is needed even on loopback, where other reads are open.
router = APIRouter(prefix="/v1", tags=["credentials"], dependencies=[MutationAuth])


@router.get("/instances/{name}/credentials", response_model=CredentialsOut)
def get_credentials(name: str, service: ServiceDep, response: Response) -> dict[str, str]:
    """The instance's application login: `{user, password, database}` for its `endpoints` URIs."""
    response.headers["Cache-Control"] = "no-store"
    return service.instance_credentials(name)
